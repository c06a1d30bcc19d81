"""What every `make gpu-check` row stands on (scripts/gpu_check.py lists the rows, scripts/gpu_check_rows.py holds
the real-size, refusal, failure and `--long` ones): the run's context (`Ctx`), a row's `Result` and `Check`, its
children through the one harness (scripts/harness.py, on `tidal.procs`), `tidal grpo` and its judgement
(`grpo`, `judge_run`), the GPU's processes (`gpu_pids`, `wait_gone`), the runner (`run_checks`: each row in
order within its budget and the run's deadline, going on past a failure), its report, its exit code and the
`LEDGER_RESULT` lines `make gpu-lease` reads.

Torch is imported only inside the functions that build models (the GPU kit's python3 has it; `--help` does not
need it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import harness  # noqa: E402 - the benches' and checks' one harness (tidal.procs)

PY = sys.executable
MISMATCH_KL_MAX = 1e-3
WARM_READY_MAX_S = 60.0
QWEN3_0_6B: dict[str, Any] = {
              "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
              "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}


class CheckFailed(Exception):
    """A check's claim does not hold; the message says which and the figures so far are kept."""


@dataclass
class Result:
    name: str
    title: str
    status: str = "not reached"
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    detail: str = ""
    log_tail: str = ""


@dataclass
class Ctx:
    """What the checks share: the mode, the scratch directory, the deadline, the figures of earlier checks."""

    cpu: bool
    work: Path
    deadline: float
    long: bool
    eager: bool = False
    """`--eager`: every `tidal grpo` run but check c's adds `--infer.enforce_eager true`."""
    logs: list[str] = field(default_factory=list)
    shared: dict[str, Any] = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.monotonic()


def run(ctx: Ctx, cmd: list[str], budget: float, log: Path) -> tuple[int, str]:
    """Run `cmd` (a `harness.run` child: its own process group, output in `log`) for at most `budget` seconds and
    never past the deadline. Returns (exit code, -9 when stopped at its budget; output)."""
    budget = max(1.0, min(budget, ctx.left()))
    code, text = harness.run(cmd, log, budget, name=log.stem)
    ctx.logs.append(str(log))
    if code is None:
        return -9, text + f"\n[gpu_check] stopped after its budget of {budget:.0f} s"
    return code, text


def tail(text: str, n: int = 25) -> str:
    return "\n".join(text.splitlines()[-n:])


def gpu_pids() -> set[int]:
    """Processes holding GPU memory (nvidia-smi); empty on CPU."""
    if shutil.which("nvidia-smi") is None:
        return set()
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30).stdout
    return {int(x) for x in out.split() if x.strip().isdigit()}


def wait_gone(before: set[int], seconds: float = 60) -> set[int]:
    """GPU processes not there `before`, waited for up to `seconds` to go."""
    end = time.monotonic() + seconds
    while (left := gpu_pids() - before) and time.monotonic() < end:
        time.sleep(1)
    return left


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 60) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read().decode()
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ready_seconds(text: str) -> float | None:
    for line in text.splitlines():
        if "inference ready after" in line:
            try:
                return float(line.split("inference ready after", 1)[1].split("s", 1)[0])
            except ValueError:
                return None
    return None


def grpo(ctx: Ctx, run_dir: Path, budget: float, log: Path, *args: str,
         default_path: bool = False) -> tuple[int, str]:
    """`tidal grpo` into `run_dir`; with `--eager` (unless `default_path`) vLLM skips compilation and CUDA-graph
    capture, which is most of its start on a GPU (the bundled model's warm start: 91 s of which ~80 s)."""
    eager = ["--infer.enforce_eager", "true"] if ctx.eager and not default_path else []
    return run(ctx, [PY, "-m", "tidal.cli", "grpo", "--output-dir", str(run_dir), *eager, *args], budget, log)


def judge_run(res: Result, code: int, text: str, run_dir: Path, steps: int,
              on_policy_steps: int | None = None) -> list[dict[str, Any]]:
    """Exit 0, metrics for steps 1..`steps`, and mismatch_kl <= `MISMATCH_KL_MAX` at the on-policy steps: every
    step where orch `max_async_level` is 0, else step 1 only (`on_policy_steps` = 1): with the default
    `max_async_level: 1` a batch of step n > 1 was sampled by policy n - 2 and trained on policy n - 1, so its
    mismatch_kl also holds one optimizer step of policy change (the bundled run on an H200: 3e-3 to 1e-2)."""
    rows = metrics(run_dir)
    kls = [r.get("mismatch_kl") for r in rows]
    res.figures["steps"] = len(rows)
    res.figures["exit"] = code
    if kls:
        res.figures["mismatch_kl max"] = max(k for k in kls if k is not None)
    if rows:
        res.figures["reward first -> last"] = f"{rows[0].get('reward/mean', float('nan')):.3f} -> " \
                                               f"{rows[-1].get('reward/mean', float('nan')):.3f}"
        peaks = [float(r["memory/peak_gb"]) for r in rows if r.get("memory/peak_gb") is not None]
        if peaks:
            res.figures["trainer peak GB"] = max(peaks)
        graphs = [int(r["flex_graphs"]) for r in rows if r.get("flex_graphs") is not None]
        if graphs:
            res.figures["flex graphs"] = max(graphs)
    res.figures["vLLM ready s"] = ready_seconds(text)
    res.log_tail = tail(text)
    if code != 0:
        raise CheckFailed(f"tidal grpo exited with {code}")
    if [r["step"] for r in rows] != list(range(1, steps + 1)):
        raise CheckFailed(f"metrics.jsonl holds steps {[r['step'] for r in rows]}, not 1..{steps}")
    judged = kls[:on_policy_steps] if on_policy_steps is not None else kls
    if any(k is None or k > MISMATCH_KL_MAX for k in judged):
        raise CheckFailed(f"mismatch_kl above {MISMATCH_KL_MAX:g} at an on-policy step: {judged} (all: {kls})")
    return rows


def qwen3_0_6b(ctx: Ctx) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tidal.models.sources import resolve_model

    out = ctx.work / "qwen3-0.6b-random"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    model: Any = Qwen3ForCausalLM(Qwen3Config(**QWEN3_0_6B))
    model.to(torch.bfloat16).save_pretrained(out)
    bundled = Path(resolve_model("tidal:tiny-reverse"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(bundled / name, out / name)
    return out


@dataclass(frozen=True)
class Check:
    name: str
    title: str
    fn: Callable[[Ctx, Result], None]
    gpu_s: float
    """Budget on a GPU (seconds)."""
    cpu_s: float | None
    """Budget in CPU mode; None: GPU only."""
    min_s: float = 30
    """Not started with less than this left."""


def default_budget(checks: tuple[Check, ...], cpu: bool, only: set[str] | None, long: bool) -> float:
    """The sum of the selected checks' budgets (CPU or GPU; the `L` rows only with `--long`): every check listed
    gets its budget unless `--budget` cuts the run, and then the checks not reached make the exit code 1."""
    total = 0.0
    for c in checks:
        budget = c.cpu_s if cpu else c.gpu_s
        if budget is None or (only is not None and c.name not in only) or (c.name.startswith("L") and not long):
            continue
        total += budget
    return total


def run_checks(ctx: Ctx, only: set[str] | None, checks: tuple[Check, ...]) -> list[Result]:
    """Each check in order, within the run's deadline; a failure (or a broken check) does not stop the next."""
    results = []
    for check in checks:
        res = Result(check.name, check.title)
        results.append(res)
        budget = check.cpu_s if ctx.cpu else check.gpu_s
        if only is not None and check.name not in only:
            res.status, res.detail = "skipped", "not selected (--only)"
            continue
        if budget is None:
            res.status, res.detail = "skipped", "GPU only"
            continue
        if ctx.left() < check.min_s:
            res.detail = f"{ctx.left():.0f} s left of the run's budget, the check needs at least {check.min_s:.0f}"
            continue
        res.figures["_budget"] = min(budget, ctx.left())
        print(f"[gpu_check] {check.name}. {check.title} (budget {res.figures['_budget']:.0f} s)", flush=True)
        started = time.monotonic()
        try:
            check.fn(ctx, res)
            if res.status == "not reached":
                res.status = "pass"
        except CheckFailed as exc:
            res.status, res.detail = "FAIL", str(exc)
        except Exception as exc:  # a broken check must not hide the next one
            res.status, res.detail = "FAIL", f"{type(exc).__name__}: {exc}"
        res.figures.pop("_budget", None)
        res.seconds = round(time.monotonic() - started, 1)
        print(f"[gpu_check] {check.name}: {res.status} in {res.seconds} s {res.detail}", flush=True)
        print(f"[gpu_check] {check.name} figures: {json.dumps(res.figures, default=str)[:1500]}", flush=True)
    for res in results:
        if res.detail != "not selected (--only)":
            print(ledger_line(res), flush=True)
    return results


def ledger_line(res: Result) -> str:
    """`LEDGER_RESULT {json}`: the check's status and figures as `make gpu-lease` (scripts/gpu_lease.py) reads them."""
    figs = "; ".join(f"{k}: {json.dumps(v, default=str) if isinstance(v, (dict, list)) else v}"
                     for k, v in res.figures.items())
    figure = f"{res.name}: " + "; ".join(x for x in (figs, res.detail) if x)
    return "LEDGER_RESULT " + json.dumps({"row": res.name, "status": res.status, "figure": figure[:500]})


def exit_code(results: list[Result]) -> int:
    """0 when every selected check passed or was skipped for a reason of its own (GPU only, no kit); 1 when one
    failed or was not reached (a check the run's budget did not reach proves nothing)."""
    return 1 if any(r.status in ("FAIL", "not reached") for r in results) else 0


def report(ctx: Ctx, results: list[Result], command: str, wall: float) -> str:
    env_fig = results[0].figures if results and results[0].name == "a" else {}
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    device = env_fig.get("device", "CPU" if ctx.cpu else "unknown GPU")
    lines = [
        "# GPU check (`make gpu-check`, scripts/gpu_check.py)", "",
        f"Run {when} on **{device}**{' (' + str(env_fig.get('gpu_memory_gib')) + ' GiB)' if not ctx.cpu else ''}"
        f", driver {env_fig.get('driver', 'n/a')}, torch {env_fig.get('torch')} (CUDA {env_fig.get('cuda')}), "
        f"vLLM {env_fig.get('vllm')}, Python {env_fig.get('python')}; {'CPU mode' if ctx.cpu else 'GPU mode'}, "
        f"{wall:.0f} s in all. Command: `{command}`.", "",
        "| check | what | result | seconds | figures |", "|---|---|---|---|---|"]
    for r in results:
        figs = "; ".join(f"{k}: {json.dumps(v, default=str) if isinstance(v, (dict, list)) else v}"
                         for k, v in r.figures.items())
        cell = (figs + ("; " if figs and r.detail else "") + r.detail).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.name} | {r.title} | {r.status} | {r.seconds} | {cell} |")
    failed = [r for r in results if r.status == "FAIL"]
    for r in failed:
        lines += ["", f"## {r.name}. {r.title}: FAIL", "", r.detail, "", "```", r.log_tail or "(no log)", "```"]
    if "bench_md" in ctx.shared:  # the sections this run's bench wrote (its command names its --out)
        sections = ["## " + sec.strip() for sec in ctx.shared["bench_md"].split("\n## ")[1:]
                    if str(ctx.work) in sec]
        lines += ["", "## Trainer benchmark tables (bench/gpu_trainer.py --quick)", "",
                  "\n\n".join(sections).replace("\n## ", "\n### ").replace("## ", "### ", 1)]
    return "\n".join(lines) + "\n"
