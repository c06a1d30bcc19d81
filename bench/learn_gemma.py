"""Does a base model learn? `tidal:gemma3-270m` (Gemma 3 270M base, no chat template) on addition as a plain-text
continuation: `python bench/learn_gemma.py` writes bench/LEARN-GEMMA.md (and .json), row by row as runs finish.

Task: `addition` with `prompt_format: text` ("A + B =", A and B in [LOW, HIGH]; the completion's first integer is
scored), which the base model solves greedily about a third of the time (transformers, with its `<bos>`: 37% on 30
single-digit problems, 33% on [1, 20]) -- between 5% and 50%, so GRPO groups have both outcomes. Per seed: one
`tidal grpo` run (examples/real_model's configs with `--model tidal:gemma3-270m`: LoRA r16/alpha 32 on all linear
layers, lr 5e-4, float32, on-policy), then one `tidal eval` of the base model and every run's final adapter on the
environment's fixed eval set (greedy, one vLLM with merged reloads), 95% Wilson intervals. Train and eval problems
come from the same small space (LOW..HIGH squared pairs), so the check is "learns the task", not "generalizes".
`--trl-seeds` adds TRL 1.16's GRPOTrainer (bench/trl_grpo.py, its defaults: loss `dapo`, beta 0, std-scaled group
advantages, transformers generation) on the same workload, seed by seed, and its final adapters to the same
`tidal eval`: issue 68's learning goal ("at equal samples tidal's defaults learn more than TRL's, on bench-learn and
one more task") on a second task and a second real model: no tidal default was tuned on them (the workload's
learning rate is the one with which tidal's first run there learned, bench/LEARN-GEMMA-EXPLORED.md; TRL runs it too).
Simplifications: few steps and short completions (CPU); the reward is the env's own.
Every vLLM start must hold the shared lock: run it as `flock /tmp/tidal-vllm.lock python bench/learn_gemma.py`.
`--deadline HH:MM` (UTC) stops starting runs that could not finish by then; the rows written so far stay, marked.
`--temperature` sets the training rollouts' sampling temperature (orch `sampling.temperature`); `--tidal-extra` passes
more `tidal grpo` arguments to tidal's runs only (an arm such as `--orch.guide_flat_groups 1`; its rewards are then the
sampled ones, `reward/sampled_mean`). Seeds can train in
separate invocations (`--no-eval`, one lock hold each, same `--work`): a finished run of the same recipe is reused, and
a last invocation listing every seed evaluates them all in one `tidal eval`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "real_model"
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "scripts"))
import harness  # noqa: E402 - the benches' one harness (tidal.procs)

MODEL = "tidal:gemma3-270m"
TRL_DIR = Path(os.environ.get("TIDAL_BENCH_TRL", REPO / ".venv" / "bench-trl"))
"""TRL 1.16 without its dependencies (`make bench-trl`), first on the TRL runs' PYTHONPATH."""


def env_arg(args: argparse.Namespace) -> str:
    """The environment as `tidal grpo` / `tidal eval` take it (YAML flow), from `env_args`."""
    return "{id: addition, args: " + json.dumps(env_args(args)) + "}"


RECIPE = ("steps", "prompts", "generations", "max_tokens", "lr", "temperature", "low", "high")


def finished(summary: Path, recipe: dict[str, Any]) -> dict[str, Any] | None:
    """The run whose summary is `summary`, marked reused, when it finished with `recipe` and its adapter is there;
    None when it never finished; a run of another recipe in the same work directory is an error."""
    if not summary.exists():
        return None
    done = json.loads(summary.read_text())
    if done.get("recipe") == recipe and Path(done["adapter"]).is_dir():
        return {**done, "reused": True}
    raise RuntimeError(f"{summary}: a run of another recipe ({done.get('recipe')}) is in {summary.parent}: use "
                       f"another --work")


def grpo(args: argparse.Namespace, work: Path, seed: int) -> dict[str, Any]:
    """One `tidal grpo` run; its metrics summary and final adapter. A run of the same recipe already finished in
    `work` (its summary `seed{seed}.json`, written last) is reused, so seeds can train in separate invocations
    (one lock hold each) and be evaluated together by a last one."""
    run_dir = work / f"seed{seed}"
    summary = work / f"seed{seed}.json"
    recipe = {k: getattr(args, k) for k in RECIPE} | ({"tidal_extra": args.tidal_extra} if args.tidal_extra else {})
    if (done := finished(summary, recipe)) is not None:
        return done
    cmd = [sys.executable, "-m", "tidal.cli", "grpo", "--train", str(EXAMPLE / "train.yaml"), "--infer",
           str(EXAMPLE / "infer.yaml"), "--orch", str(EXAMPLE / "orch.yaml"), "--model", MODEL, "--output-dir",
           str(run_dir), "--orch.env", f"[{env_arg(args)}]", "--orch.max_steps", str(args.steps),
           "--orch.batch_size", str(args.prompts * args.generations), "--orch.rollouts_per_example",
           str(args.generations), "--orch.sampling.max_tokens", str(args.max_tokens), "--orch.seed", str(seed),
           "--orch.sampling.seed", str(seed), "--orch.sampling.temperature", str(args.temperature), "--train.seed",
           str(seed), "--train.learning_rate", str(args.lr), "--train.export.gguf", "null", "--infer.port",
           str(args.port), *shlex.split(args.tidal_extra)]
    t0 = time.monotonic()
    code, text = harness.run(cmd, work / f"seed{seed}.log", args.run_budget_s, env=harness.child_env(),
                             name=f"grpo_seed{seed}")
    if code != 0:
        raise RuntimeError(f"tidal grpo seed {seed} failed (exit {code}): {text[-2000:]}")
    from tidal.monitor.metrics import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    k = min(3, len(rows))
    rewards = [r.get("reward/sampled_mean", r["reward/mean"]) for r in rows]  # the policy's (orch guide_flat_groups)
    out = {"seed": seed, "total_s": time.monotonic() - t0, "adapter": str(run_dir / "final" / "adapter"),
            "step_s": statistics.mean(r["step_time_s"] for r in rows[1:] or rows),
            "reward_first": statistics.mean(rewards[:k]), "reward_last": statistics.mean(rewards[-k:]),
            "mismatch_kl_1": rows[0]["mismatch_kl"], "steps": len(rows), "recipe": recipe,
            "rewards": rewards}
    from tidal.paths import write_atomic

    write_atomic(summary, json.dumps(out, indent=1))
    return out


def env_args(args: argparse.Namespace) -> dict[str, Any]:
    """The environment's arguments as `env_arg` gives them to tidal (bench/trl_grpo.py's `--env-args`)."""
    evaluated = {"eval_all": True} if args.eval_all else {"eval_size": args.eval_size}
    return {"prompt_format": "text", "low": args.low, "high": args.high, **evaluated}


def trl(args: argparse.Namespace, work: Path, seed: int) -> dict[str, Any]:
    """One TRL 1.16 GRPOTrainer run (bench/trl_grpo.py, TRL's defaults: loss `dapo`, beta 0, rewards scaled by the
    group's std, transformers generation, gradient checkpointing) on the same workload as `grpo`: the same problems
    (the env's sampler, seed `seed`), prompts x completions per optimizer step, tokens, temperature, learning rate,
    LoRA r16/alpha 32 on all linear layers, float32; its summary like `grpo`'s, reused the same way."""
    summary = work / f"trl_seed{seed}.json"
    recipe = {k: getattr(args, k) for k in RECIPE}
    if (done := finished(summary, recipe)) is not None:
        return done
    from tidal.models.sources import resolve_model

    out, adapter = work / f"trl_seed{seed}_steps.json", work / f"trl_seed{seed}_adapter"
    cmd = [sys.executable, str(REPO / "bench" / "trl_grpo.py"), "--env", "addition", "--env-args",
           json.dumps(env_args(args)), "--model", str(resolve_model(MODEL)), "--out", str(out), "--steps",
           str(args.steps), "--prompts", str(args.prompts), "--generations", str(args.generations), "--max-tokens",
           str(args.max_tokens), "--lr", str(args.lr), "--temperature", str(args.temperature), "--seed", str(seed),
           "--save-adapter", str(adapter)]
    t0 = time.monotonic()
    code, text = harness.run(cmd, work / f"trl_seed{seed}.log", args.run_budget_s, env=harness.child_env(TRL_DIR),
                             name=f"trl_seed{seed}")
    if code != 0:
        raise RuntimeError(f"TRL seed {seed} failed (exit {code}): {text[-2000:]}")
    steps = json.loads(out.read_text())["steps"]
    rewards = [s["reward"] for s in steps]
    k = min(3, len(rewards))
    gaps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steps, steps[1:], strict=False)]
    res = {"framework": "TRL", "seed": seed, "total_s": time.monotonic() - t0, "adapter": str(adapter),
           "step_s": statistics.mean(gaps) if gaps else steps[0]["elapsed_s"],
           "reward_first": statistics.mean(rewards[:k]), "reward_last": statistics.mean(rewards[-k:]),
           "mismatch_kl_1": float("nan"), "steps": len(steps), "recipe": recipe, "rewards": rewards}
    from tidal.paths import write_atomic

    write_atomic(summary, json.dumps(res, indent=1))
    return res


def greedy(args: argparse.Namespace, work: Path, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """`tidal eval` of the base model and the runs' adapters: label -> accuracy with its 95% Wilson interval."""
    out = work / "eval.json"
    cmd = [sys.executable, "-m", "tidal.cli", "eval", "--model", MODEL, "--env", env_arg(args), "--max-tokens",
           str(args.max_tokens), "--max-model-len", "256", "--out", str(out), "--quiet", "--show-samples", "3"]
    for r in runs:
        cmd += ["--adapter", r["adapter"]]
    code, text = harness.run(cmd, work / "eval.log", args.run_budget_s, env=harness.child_env(), name="tidal_eval")
    if code != 0:
        raise RuntimeError(f"tidal eval failed (exit {code}): {text[-2000:]}")
    report = json.loads(out.read_text())
    res: dict[str, Any] = {"examples": report["examples"], "samples": {}}
    for row in report["rows"]:
        g = row["greedy"]
        res[row["label"]] = (g["accuracy"], g["accuracy_lo"], g["accuracy_hi"])
        res["samples"][row["label"]] = [s.get("completion", "") for s in row.get("samples", [])][:3]
    return res


def cpu_model() -> str:
    """This machine's CPU model (/proc/cpuinfo), or 'an unknown CPU'."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.is_file() else []
    return next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), "an unknown CPU")


def evaluated(args: argparse.Namespace) -> str:
    """What the greedy accuracy was measured on, in words."""
    if args.eval_all:
        n = (args.high - args.low + 1) ** 2
        return (f"every one of the task's {n} problems once (`eval_all`: its exact greedy accuracy, no sampling "
                f"noise; the intervals treat them as a sample)")
    return f"the env's fixed {args.eval_size}-problem set (drawn with replacement, seed 1234)"


def fmt(acc: tuple[float, float, float] | None) -> str:
    return "-" if acc is None else f"{acc[0]:.3f} [{acc[1]:.3f}, {acc[2]:.3f}]"


def write(args: argparse.Namespace, runs: list[dict[str, Any]], evals: dict[str, Any] | None, note: str) -> None:
    """bench/LEARN-GEMMA.md and .json (whole files, temp + rename), from what has finished so far."""
    from tidal.paths import write_atomic

    lines = ["# A base model learns: `tidal:gemma3-270m` on addition as plain text (`bench/learn_gemma.py`)", "",
             f"Written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {cpu_model()}, {os.cpu_count()} cores; "
             f"the runs of one invocation run one at a time (times from other invocations or machines do not "
             f"compare). {note}", "",
             f"Workload: Gemma 3 270M base (Q4_K_M GGUF dequantized to float32), `addition` prompt_format text, "
             f"A, B in [{args.low}, {args.high}], {args.prompts} prompts x {args.generations} completions x <= "
             f"{args.max_tokens} tokens per step at temperature {args.temperature}, {args.steps} steps, lr {args.lr}, "
             f"LoRA r16/alpha 32 (all linear), on-policy"
             f"{f'; tidal with `{args.tidal_extra}` (its rewards: the sampled ones)' if args.tidal_extra else ''}. "
             f"Greedy accuracy: `tidal eval` on {evaluated(args)}, 95% Wilson interval in brackets.", ""]
    base = evals.get("base") if evals else None
    lines += [f"Base model greedy accuracy: {fmt(base)}", "",
              "| side | seed | steps | s/step | total (s) | reward first 3 | reward last 3 | step-1 mismatch_kl | "
              "greedy before | greedy after |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        after = evals.get(r["adapter"]) if evals else None
        lines.append(f"| {r.get('framework', 'tidal')} | {r['seed']} | {r['steps']} | {r['step_s']:.1f} | "
                     f"{r['total_s']:.0f} | {r['reward_first']:.3f} | {r['reward_last']:.3f} | "
                     f"{r['mismatch_kl_1']:.1e} | {fmt(base)} | {fmt(after)} |")
    sides = {side: [r for r in runs if r.get("framework", "tidal") == side] for side in ("tidal", "TRL")}
    summary: dict[str, tuple[float, float, float, float]] = {}
    for side, rs in sides.items():
        if not (evals and rs and all(r["adapter"] in evals for r in rs)):
            continue
        accs = [evals[r["adapter"]][0] for r in rs]
        sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
        summary[side] = (statistics.mean(accs), sd, min(accs), max(accs))
        lines += ["", f"{side}, greedy after, over {len(accs)} seeds: {statistics.mean(accs):.3f} +- {sd:.3f} "
                  f"({min(accs):.3f}-{max(accs):.3f}; sample std); whole runs {min(r['total_s'] for r in rs):.0f}-"
                  f"{max(r['total_s'] for r in rs):.0f} s, {statistics.mean(r['step_s'] for r in rs):.1f} s/step."]
        if base:
            above = sum(evals[r["adapter"]][0] > base[2] for r in rs)
            clear = sum(evals[r["adapter"]][1] > base[2] for r in rs)
            lines += ["", f"{side} seeds whose greedy accuracy after is above the base's interval (> {base[2]:.3f}): "
                      f"{above} of {len(rs)}; whose own interval lies wholly above it: {clear} of {len(rs)}."]
    if len(summary) == 2:
        (m1, s1, lo1, hi1), (m2, s2, lo2, hi2) = summary["tidal"], summary["TRL"]
        spread = "outside" if (m1 - s1 > m2 + s2 or m2 - s2 > m1 + s1) else "inside"
        ranges = "do not overlap" if (lo1 > hi2 or lo2 > hi1) else "overlap"
        se = (s1 ** 2 / len(sides["tidal"]) + s2 ** 2 / len(sides["TRL"])) ** 0.5
        lines += ["", f"Issue 68's learning goal on this second task and second real model, at equal samples: tidal "
                  f"{m1:.3f} against TRL {m2:.3f}, difference {m1 - m2:+.3f}, {spread} the spread (mean +- std "
                  f"intervals), min-max ranges {ranges}, Welch's t {(m1 - m2) / se if se else float('nan'):.1f}."]
    if evals:
        lines += ["", "Greedy completions (first 3 problems):", ""]
        lines += [f"- {label}: {json.dumps(s)}" for label, s in evals["samples"].items()]
    if args.extra:
        lines += ["", Path(args.extra).read_text().rstrip()]
    out = Path(args.out)
    write_atomic(out, "\n".join(lines) + "\n")
    write_atomic(out.with_suffix(".json"), json.dumps({"args": vars(args), "runs": runs, "evals": evals,
                                                        "note": note}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2], help="tidal's seeds")
    p.add_argument("--trl-seeds", type=int, nargs="*", default=[],
                   help="TRL 1.16's seeds on the same workload (bench/trl_grpo.py; `make bench-trl` installs TRL)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--temperature", type=float, default=1.0,
                   help="orch sampling.temperature of the training rollouts (the trainer scores at it too)")
    p.add_argument("--tidal-extra", default="", help="more `tidal grpo` arguments of tidal's runs (part of their "
                   "recipe, e.g. \"--orch.guide_flat_groups 1\"); TRL's runs do not take them")
    p.add_argument("--low", type=int, default=0)
    p.add_argument("--high", type=int, default=19)
    p.add_argument("--eval-size", type=int, default=128, help="problems of the env's fixed eval set")
    p.add_argument("--eval-all", action="store_true", help="evaluate every problem of the task once (addition's "
                   "`eval_all`; --eval-size then unused and refused when given)")
    p.add_argument("--port", type=int, default=8377)
    p.add_argument("--run-budget-s", type=float, default=3600,
                   help="one `tidal grpo` run's limit (1800 s stopped a 20-step run at step 18 on the shared machine)")
    p.add_argument("--work", default="/tmp/learn_gemma")
    p.add_argument("--out", default=str(REPO / "bench" / "LEARN-GEMMA.md"), help="the table (and .json beside it)")
    p.add_argument("--no-eval", action="store_true", help="train only (a later invocation with the same --work "
                   "reuses the finished runs and evaluates them all in one `tidal eval`)")
    p.add_argument("--extra", help="a markdown file appended under the table (e.g. the recipes explored before)")
    p.add_argument("--deadline", help="HH:MM UTC: start no run after it minus --reserve-s")
    p.add_argument("--reserve-s", type=float, default=900, help="time kept for the evaluation before the deadline")
    args = p.parse_args()
    if args.eval_all and "--eval-size" in sys.argv:
        p.error("--eval-all evaluates every problem: --eval-size would have no effect")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    note = "Complete."
    plan = [(grpo, seed) for seed in args.seeds] + [(trl, seed) for seed in args.trl_seeds]
    for run, seed in plan:
        if args.deadline:
            hh, mm = (int(x) for x in args.deadline.split(":"))
            now = time.gmtime()
            left = (hh * 60 + mm - now.tm_hour * 60 - now.tm_min) * 60
            if left < args.reserve_s + (runs[-1]["total_s"] if runs else 300):
                note = (f"PARTIAL: runs {[(r.get('framework', 'tidal'), r['seed']) for r in runs]} of seeds "
                        f"{args.seeds} (tidal) and {args.trl_seeds} (TRL) ran before the deadline.")
                break
        runs.append(run(args, work, seed))
        write(args, runs, None, "PARTIAL: training rows so far, evaluation pending.")
    if args.no_eval:
        write(args, runs, None, f"PARTIAL: training rows only (--no-eval). {note}")
        return
    write(args, runs, greedy(args, work, runs), note)


if __name__ == "__main__":
    main()
