"""Reward rising through the agent endpoint: a stock SDK agent with a tool, multi-turn, trained on SmolLM2.

The program is examples/agent/calc_agent.py (`--sdk openai`) or examples/agent/calc_agent_anthropic.py (`--sdk
anthropic`), unchanged: it asks the model "What is A + B?" (the `addition` task, `--low`..`--high`) with an `add`
calculator tool, runs the tool when the model calls it (Hermes `<tool_call>` JSON, parsed by the endpoint into
`tool_calls` / `tool_use`), sends the result back and asks again (at most 3 calls). SmolLM2's chat template ignores
`tools=`, so the agent env runs with `tool_prompt: system` (`--tool-prompt`: tidal writes the tool block into the
system message; `tidal.envs.agent.toolprompt`). The reward is the task's: 1 when the last integer of the last
answer is A + B. `tidal grpo` trains `tidal:smollm2-135m-instruct` (LoRA, float32, on-policy, CPU) with the configs
in examples/agent/smollm2/; each rollout is one run of the program (as a function: `--program`) against its session.

Per seed: per step the training reward, `mismatch_kl` (every step is on-policy: at the float32 level when every
trained token is exactly a sampled one), model calls per session (1 + the tool rounds: > 1 means the multi-turn
splice ran), forks, failed episodes; then (`--eval-only`) greedy accuracy with 95% Wilson intervals of the base
model and of each final adapter on a held-out set (`tidal eval --env <the agent env>`: the same program through the
same endpoint at temperature 0, `--eval-examples` problems drawn with seed 7). Each invocation runs the seeds it is
given and merges them into --json (one file per SDK; runs of another workload are dropped), then rewrites the report
from both SDKs' files. One invocation per seed under the machine's heavy lock:
    flock /tmp/tidal-heavy.lock python bench/agent_learn.py --seeds 0
    flock /tmp/tidal-heavy.lock python bench/agent_learn.py --sdk anthropic --seeds 0
    flock /tmp/tidal-heavy.lock python bench/agent_learn.py --eval-only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "scripts"))
import harness  # noqa: E402 - the benches' one harness (tidal.procs)

MODEL = "tidal:smollm2-135m-instruct"
CONFIGS = REPO / "examples" / "agent" / "smollm2"
MODULES = {"openai": "calc_agent", "anthropic": "calc_agent_anthropic"}
SFT_JSON = REPO / "bench" / "agent_learn-sft.json"
JSONS = {"openai": REPO / "bench" / "agent_learn.json", "anthropic": REPO / "bench" / "agent_learn-anthropic.json"}


def agent_env(args: argparse.Namespace) -> str:
    """The orch `env` entry (YAML flow) running the SDK's calculator program as a command (this Python) or a
    function."""
    mod = MODULES[args.sdk]
    how = (f"command: [{sys.executable}, examples/agent/{mod}.py]" if args.program == "command" else
           f"function: examples.agent.{mod}:main")
    return (f"{{id: agent, args: {{{how}, task: {{id: addition, args: {{low: {args.low}, high: {args.high}}}}}, "
            f"timeout_s: 300, max_calls: 4, tool_prompt: {args.tool_prompt}}}}}")


def child_env() -> dict[str, str]:
    """The harness's environment with the repository root on PYTHONPATH (the function form imports `examples`)."""
    return harness.child_env(REPO)


def base_model(args: argparse.Namespace) -> str:
    """The policy RL starts from: the warm-started model (`--sft`) unless `--no-warm-start`."""
    return str(Path(args.work) / "sft") if args.warm_start else MODEL


def sft(args: argparse.Namespace) -> dict[str, Any]:
    """The `tidal sft` warm start on the agent's reference transcripts (examples/agent/calc_sft.py), full weights
    (float32) saved to `{work}/sft`."""
    out = Path(args.work) / "sft"
    cmd = [sys.executable, "-m", "tidal.cli", "sft", "--train.model", MODEL, "--train.lora", "false",
           "--train.max_steps", str(args.sft_steps),
           "--train.learning_rate", str(args.sft_lr), "--train.warmup_steps", "0", "--train.lr_scheduler_type",
           "constant", "--train.sequence_len", "512", "--train.per_device_train_batch_size", "8", "--train.seed", "0",
           "--sft.examples_per_step", str(args.sft_examples),
           "--sft.env", "examples.agent.calc_sft:CalcToolTranscripts",
           "--sft.env_args", f"{{low: {args.low}, high: {args.high}, answer_share: {args.sft_answer_share}}}",
           "--sft.save_to", str(out)]
    start, load0 = time.monotonic(), os.getloadavg()[0]
    code, text = harness.run(cmd, Path(args.work) / "sft.log", 1200, env=child_env(), name="agent-sft")
    if code != 0:
        raise RuntimeError(f"tidal sft failed (exit {code}): {text[-3000:]}")
    return {"command": " ".join(cmd), "total_s": time.monotonic() - start, "load_at_start": load0,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "steps": args.sft_steps,
            "lr": args.sft_lr,
            "examples_per_step": args.sft_examples, "answer_share": args.sft_answer_share}


def grpo_cmd(args: argparse.Namespace, seed: int, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "tidal.cli", "grpo", "--model", base_model(args),
            "--train", str(CONFIGS / "train.yaml"),
            "--infer", str(CONFIGS / "infer.yaml"), "--orch", str(CONFIGS / "orch.yaml"), "--output-dir", str(run_dir),
            "--orch.env", f"[{agent_env(args)}]",
            "--orch.max_steps", str(args.steps), "--orch.batch_size", str(args.prompts * args.generations),
            "--orch.rollouts_per_example", str(args.generations), "--orch.sampling.max_tokens", str(args.max_tokens),
            "--orch.seed", str(seed), "--orch.sampling.seed", str(seed), "--train.seed", str(seed),
            "--train.learning_rate", str(args.lr), "--infer.port", str(args.port)]


def one_seed(args: argparse.Namespace, work: Path, seed: int) -> dict[str, Any]:
    """One `tidal grpo` run; its per-step figures."""
    from tidal.monitor.metrics import read_metrics

    run_dir = work / f"seed{seed}"
    cmd = grpo_cmd(args, seed, run_dir)
    loads: list[float] = []
    start = time.monotonic()
    child = harness.start(f"agent-learn-{seed}", cmd, work / f"seed{seed}.log", env=child_env())
    try:
        while child.poll() is None:
            if time.monotonic() - start > args.timeout:
                raise TimeoutError(f"seed {seed} ran past {args.timeout} s (log {work}/seed{seed}.log)")
            loads.append(os.getloadavg()[0])
            time.sleep(1)
    finally:
        harness.stop(child)
    total = time.monotonic() - start
    if child.poll() != 0:
        raise RuntimeError(f"seed {seed}: tidal grpo exited {child.poll()}; log {work}/seed{seed}.log")
    rows = read_metrics(run_dir / "metrics.jsonl")
    per = [{"step": r["step"], "reward": r["reward/mean"], "mismatch_kl": r.get("mismatch_kl", float("nan")),
            "sessions": r.get("agent/sessions", 0.0), "calls": r.get("agent/calls", 0.0),
            "forks": r.get("agent/forks", 0.0), "failures": r.get("agent/failures", 0.0),
            "rows": r.get("agent/rows", 0.0),
            "off_policy_level": r.get("off_policy_level", 0), "step_time_s": r.get("step_time_s", float("nan"))}
           for r in rows]
    return {"seed": seed, "total_s": total, "load": statistics.mean(loads or [float("nan")]),
            "adapter": str(run_dir / "final" / "adapter"), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(cmd), "steps": per}


def greedy(args: argparse.Namespace, work: Path, adapters: list[str]) -> dict[str, Any]:
    """`tidal eval` through the agent env (function form: greedy, the same program) of the base model and
    `adapters`: label -> accuracy and 95% interval; plus `command`."""
    out = work / "eval.json"
    env = agent_env(argparse.Namespace(**{**vars(args), "program": "function"}))
    cmd = [sys.executable, "-m", "tidal.cli", "eval", "--model", base_model(args), "--env", env, "--num-examples",
           str(args.eval_examples), "--seed", "7", "--max-tokens", str(args.max_tokens), "--max-model-len", "512",
           "--out", str(out), "--quiet", "--show-samples", "1", *(a for p in adapters for a in ("--adapter", p))]
    code, text = harness.run(cmd, work / "eval.log", 3600, env=child_env(), name="agent-eval")
    if code != 0:
        raise RuntimeError(f"tidal eval failed (exit {code}): {text[-3000:]}")
    report = json.loads(out.read_text())
    res: dict[str, Any] = {"command": " ".join(cmd), "examples": report["examples"], "sample_s": report["sample_s"]}
    for row in report["rows"]:
        g = row["greedy"]
        res[row["label"]] = {"accuracy": g["accuracy"], "lo": g["accuracy_lo"], "hi": g["accuracy_hi"]}
    return res


def workload(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ("steps", "prompts", "generations", "max_tokens", "lr", "low", "high",
                                          "program", "sdk", "tool_prompt", "warm_start")}


def load(path: Path, wl: dict[str, Any]) -> dict[str, Any]:
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("workload") == wl:
            return saved
        print(f"agent-learn: {path} holds another workload; starting it again", flush=True)
    return {"workload": wl, "runs": {}, "eval": None}


def save(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def spread(xs: list[float], fmt: str = ".3f") -> str:
    if not xs:
        return "-"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):{fmt}} ± {sd:{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"


def first_last(run: dict[str, Any], k: int = 3) -> tuple[float, float]:
    r = [s["reward"] for s in run["steps"]]
    return statistics.mean(r[:k]), statistics.mean(r[-k:])


def per_session(step: dict[str, Any]) -> float:
    """Model calls per session (1 + the tool rounds)."""
    return step["calls"] / step["sessions"] if step["sessions"] else float("nan")


def greedy_cell(ev: dict[str, Any] | None, label: str) -> str:
    acc = ev.get(label) if ev else None
    return f"{acc['accuracy']:.3f} [{acc['lo']:.3f}, {acc['hi']:.3f}]" if acc else "-"


def seed_row(run: dict[str, Any], ev: dict[str, Any] | None) -> str:
    a, b = first_last(run)
    kls = [s["mismatch_kl"] for s in run["steps"]]
    fails = sum(s["failures"] for s in run["steps"])
    forks = sum(s["forks"] for s in run["steps"])
    c0 = statistics.mean(per_session(s) for s in run["steps"][:3])
    c1 = statistics.mean(per_session(s) for s in run["steps"][-3:])
    return (f"| {run['seed']} | {a:.3f} | {b:.3f} | {b - a:+.3f} | {c0:.2f} → {c1:.2f} | {max(kls):.1e} | "
            f"{int(fails)} | {int(forks)} | {greedy_cell(ev, run['adapter'])} | {run['total_s']:.0f} | "
            f"{run['load']:.1f} |")


def section(sdk: str, data: dict[str, Any]) -> list[str]:
    """The report's part for one SDK's runs."""
    runs = [data["runs"][k] for k in sorted(data["runs"], key=int)]
    ev, wl = data.get("eval"), data["workload"]
    lines = [
        f"## `{sdk}` SDK: examples/agent/{MODULES[sdk]}.py",
        "",
        f"Workload: `{MODEL}`, the program run unchanged against its session as a "
        f"{'command (a process per session)' if wl['program'] == 'command' else 'function (agent args.function)'}, "
        f"agent args `tool_prompt: {wl['tool_prompt']}`, task `addition` {wl['low']}..{wl['high']}, {wl['prompts']} "
        f"prompts x {wl['generations']} sessions per step, <= {wl['max_tokens']} tokens per call, <= 3 calls per "
        f"session, {wl['steps']} steps, lr {wl['lr']}, LoRA r16 / alpha 32, float32, on-policy (tidal's CPU "
        f"default). Reward: the task's, 1 when the last integer of the last answer is A + B.",
        "",
        "Command (seed " + (runs[0]["seed"].__str__() + "): `" + runs[0]["command"].replace(str(REPO) + "/", "")
                             if runs else "-): `") + "`",
        "",
        "| seed | reward first 3 | reward last 3 | change | calls per session first 3 → last 3 | max "
        "mismatch_kl (every step) | failed episodes | forks | greedy after (held-out, 95% Wilson) | total (s) | "
        "mean load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(seed_row(r, ev) for r in runs),
        "",
    ]
    if runs:
        firsts, lasts = zip(*(first_last(r) for r in runs), strict=True)
        change = [b - a for a, b in zip(firsts, lasts, strict=True)]
        calls = [statistics.mean(per_session(s) for s in r["steps"][-3:]) for r in runs]
        lines += [f"Over {len(runs)} seeds (mean ± sample std (min-max)): reward first 3 steps {spread(list(firsts))}"
                  f", last 3 steps {spread(list(lasts))}; change {spread(change)}; calls per session, last 3 steps "
                  f"{spread(calls, '.2f')}; mismatch_kl over every step of every seed: max "
                  f"{max(s['mismatch_kl'] for r in runs for s in r['steps']):.1e}.", ""]
    if ev:
        after = [ev[r["adapter"]]["accuracy"] for r in runs if r["adapter"] in ev]
        lines += [f"Greedy accuracy on {ev['examples']} held-out problems (drawn with seed 7) through the same program "
                  f"and endpoint at temperature 0 (`tidal eval --env <agent env>`), 95% Wilson intervals: base "
                  f"{greedy_cell(ev, 'base')}; after training {spread(after)} over {len(after)} adapters.", ""]
    lines += ["Per step (reward / mismatch_kl / calls per session):", ""]
    for r in runs:
        cells = ", ".join(f"{s['reward']:.2f}/{s['mismatch_kl']:.0e}/{per_session(s):.2f}" for s in r["steps"])
        lines.append(f"- seed {r['seed']}: {cells}")
    return lines + [""]


NOTES = REPO / "bench" / "agent_learn_notes.md"
"""Hand-written notes appended to the report (the probe, what the runs do and do not show)."""


def report(datas: dict[str, dict[str, Any]]) -> str:
    lines = [
        "# Reward rising through the agent endpoint: stock SDK agents with a tool, on SmolLM2 "
        "(`bench/agent_learn.py`)",
        "",
        f"Written by bench/agent_learn.py on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} from "
        f"{', '.join(str(JSONS[k].relative_to(REPO)) for k in datas)}; the machine is shared (2 CPUs, other "
        f"sessions' work between runs; each run held the machine's heavy lock: the mean 1-min load of each run is "
        f"given).",
        "",
    ]
    for sdk, data in datas.items():
        lines += section(sdk, data)
    if NOTES.is_file():
        lines += [NOTES.read_text().rstrip(), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0])
    ap.add_argument("--sdk", choices=sorted(MODULES), default="openai")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--low", type=int, default=100)
    ap.add_argument("--high", type=int, default=999)
    ap.add_argument("--program", choices=["command", "function"], default="function")
    ap.add_argument("--tool-prompt", choices=["system", "program"], default="system")
    ap.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=True,
                    help="start RL from the `tidal sft` warm start in {work}/sft (made by --sft)")
    ap.add_argument("--sft", action="store_true", help="first run the warm start (then the seeds given)")
    ap.add_argument("--sft-steps", type=int, default=12)
    ap.add_argument("--sft-lr", type=float, default=5e-5)
    ap.add_argument("--sft-examples", type=int, default=16)
    ap.add_argument("--sft-answer-share", type=float, default=0.5)
    ap.add_argument("--eval-only", action="store_true", help="no training: the greedy evaluation of the saved runs")
    ap.add_argument("--report-only", action="store_true", help="no runs: the report again from the json files")
    ap.add_argument("--eval-examples", type=int, default=64)
    ap.add_argument("--port", type=int, default=8610)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--work", default="/tmp/tidal-bench-agent-learn")
    ap.add_argument("--out", default=str(REPO / "bench" / "AGENT-LEARN.md"))
    args = ap.parse_args()
    work, path = Path(args.work) / args.sdk, JSONS[args.sdk]
    work.mkdir(parents=True, exist_ok=True)
    data = load(path, workload(args))
    if args.sft:
        SFT_JSON.write_text(json.dumps(sft(args), indent=1))
        print(f"agent-learn: warm start saved to {base_model(args)}", flush=True)
    for seed in [] if args.eval_only or args.report_only else args.seeds:
        run = one_seed(args, work, seed)
        data["runs"][str(seed)] = run
        a, b = first_last(run)
        print(f"agent-learn: {args.sdk} seed {seed}: reward {a:.3f} -> {b:.3f} in {run['total_s']:.0f} s", flush=True)
        save(path, data)
    if args.eval_only:
        adapters = [r["adapter"] for r in data["runs"].values() if Path(r["adapter"]).is_dir()]
        data["eval"] = greedy(args, work, adapters)
        save(path, data)
    datas = {k: json.loads(JSONS[k].read_text()) for k in MODULES if JSONS[k].is_file()}
    datas = {k: d for k, d in datas.items() if d.get("runs")}
    Path(args.out).write_text(report(datas))
    print(f"agent-learn: wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
