"""Per-step overhead of `tidal grpo`, old code against new in one invocation: writes bench/STEP-OVERHEAD.md.

Runs `tidal grpo` on the bench-learn workload (`tidal:smollm2-135m-instruct`, addition, 8 prompts x 8 completions x
<= 64 tokens, LoRA r16; `--model bundled`: the bundled tiny model with `make run`'s defaults and the same shape)
alternately from two source trees, A (`--baseline-rev`, extracted with `git archive` into a temp dir: no worktree
or branch is touched) and B (this checkout), `--rounds` times (A, B, A, B, ...). Each run's metrics.jsonl gives every
step's accounting (the keys the trainer and orchestrator write; the `timing/*` ones from the baseline on):

    step_time_s = rollout_time_s                  the orchestrator's sampling and scoring of the batch
                + train_time_s                    the trainer's step (packing, forward/backward, optimizer)
                + probe_time_s                    the policy identity probe's forward (issue 66)
                + timing/publish_s                the policy written to broadcasts/ (adapter, merged copy, STABLE)
                + timing/policy_ready_s           STABLE -> the orchestrator's poll sees it, vLLM reloads, identity
                + timing/assemble_s               advantages, filters, TrainingBatch
                + timing/handoff_s                the orchestrator's put -> the trainer holds the batch (at most
                                                  the trainer's wait_time_s: the part it waited for)
                + other                           the rest (tokenization of prompts, metrics rows, logging, ...)

Step 1 (compiles, first loads) and step 2 are left out of the statistics. The machine may be shared: only ratios
of one invocation mean anything; the 1-min load average is sampled and reported. Run it under the vLLM test lock
(`flock /tmp/tidal-vllm.lock`) when it takes under 10 min (`--steps 6 --rounds 1`), else under the bench lock.

    python bench/step_overhead.py --baseline-rev 5bb0cea --steps 8 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "real_model"
PARTS = ["rollout_time_s", "train_time_s", "probe_time_s", "timing/publish_s", "timing/policy_ready_s",
         "timing/assemble_s", "timing/handoff_s"]
"""The named parts of a step, in the order of the table (see the module doc)."""


def workload(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """`tidal grpo`'s command line for one run."""
    shape = ["--orch.max_steps", str(args.steps), "--orch.batch_size", "64", "--orch.rollouts_per_example", "8",
             "--orch.sampling.max_tokens", "64", "--orch.seed", "0", "--orch.sampling.seed", "0", "--train.seed", "0",
             "--output-dir", str(run_dir), "--infer.port", str(args.port)]
    if args.model == "bundled":
        return ["grpo", *shape]
    return ["grpo", "--train", str(EXAMPLE / "train.yaml"), "--infer", str(EXAMPLE / "infer.yaml"), "--orch",
            str(EXAMPLE / "orch.yaml"), "--train.export.gguf", "null", *shape]


def baseline_tree(rev: str, into: Path) -> Path:
    """`rev`'s src/ (git archive: read-only on the repository)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def one_run(src: Path, run_dir: Path, args: argparse.Namespace, loads: list[float]) -> list[dict[str, Any]]:
    """One `tidal grpo` run from `src`; its metrics rows. The load average is sampled every second meanwhile."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(REPO)]), "TIDAL_PLAIN": "1"}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(1.0):
            loads.append(os.getloadavg()[0])

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    with open(run_dir.with_suffix(".log"), "w") as log:
        code = subprocess.run([sys.executable, "-m", "tidal.cli", *workload(args, run_dir)], env=env, stdout=log,
                              stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    stop.set()
    if code != 0:
        raise SystemExit(f"tidal grpo from {src} exited with {code}; see {run_dir.with_suffix('.log')}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def accounting(rows: list[dict[str, Any]], skip: int) -> dict[str, list[float]]:
    """Per part, its values over the steps after the first `skip`; `other` = step time less the named parts."""
    out: dict[str, list[float]] = {k: [] for k in ["step_time_s", *PARTS, "other"]}
    for r in rows[skip:]:
        named = 0.0
        for k in ["step_time_s", *PARTS]:
            v = float(r.get(k) or 0.0)
            if k == "timing/handoff_s":  # only the part the trainer waited for (a batch may wait for the trainer)
                v = min(v, float(r.get("wait_time_s") or 0.0))
            out[k].append(v)
            named += v if k != "step_time_s" else 0.0
        out["other"].append(float(r["step_time_s"]) - named)
    return out


def mmm(values: list[float]) -> str:
    return (f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})" if values else "-")


def report(results: dict[str, dict[str, list[float]]], args: argparse.Namespace, loads: list[float]) -> str:
    a, b = results["A"], results["B"]
    lines = [
        "# Per-step overhead of `tidal grpo`: old (A) against new (B) in one invocation", "",
        f"Written by bench/step_overhead.py on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"A = `{args.baseline_rev}`, B = this checkout; model {args.model}; {args.steps} steps per run, "
        f"{args.rounds} round(s) A,B interleaved; statistics over steps {args.skip + 1}..{args.steps} of every run. "
        f"1-min load average during the runs: mean {statistics.mean(loads):.1f} (min {min(loads):.1f}, max "
        f"{max(loads):.1f}) on {os.cpu_count()} CPUs: the machine was shared, compare ratios only.", "",
        "Median (min-max) seconds per step:", "",
        "| part | A | B | B / A (medians) |", "|---|---|---|---|"]
    for k in ["step_time_s", *PARTS, "other"]:
        ma, mb = (statistics.median(x[k]) if x[k] else float("nan") for x in (a, b))
        ratio = f"{mb / ma:.2f}" if ma > 0 else "-"
        lines.append(f"| {k} | {mmm(a[k])} | {mmm(b[k])} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-rev", required=True, help="the old code (A): a git revision of this repository")
    ap.add_argument("--model", choices=["real", "bundled"], default="real")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--skip", type=int, default=2, help="first steps of each run left out (compiles, first loads)")
    ap.add_argument("--port", type=int, default=8700)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    ap.add_argument("--work", type=Path, default=None, help="where runs go (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "STEP-OVERHEAD.md")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="tidal-step-overhead-"))
    work.mkdir(parents=True, exist_ok=True)
    trees = {"A": baseline_tree(args.baseline_rev, Path(tempfile.mkdtemp(prefix="tidal-baseline-"))),
             "B": REPO / "src"}
    results: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
    raw: dict[str, list[list[dict[str, Any]]]] = {"A": [], "B": []}
    loads: list[float] = []
    for r in range(args.rounds):
        for side in ("A", "B"):
            t0 = time.monotonic()
            rows = one_run(trees[side], work / f"{side}{r}", args, loads)
            raw[side].append(rows)
            for k, v in accounting(rows, args.skip).items():
                results[side].setdefault(k, []).extend(v)
            print(f"[step-overhead] {side} round {r}: {len(rows)} steps in {time.monotonic() - t0:.0f} s, "
                  f"median step {statistics.median(results[side]['step_time_s']):.2f} s", flush=True)
    (work / "raw.json").write_text(json.dumps(raw))
    text = report(results, args, loads)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
