"""`make bench-policy-check`: what the policy identity check costs beside a training step, in one `tidal grpo` run.

The check (`tidal.orchestrator.identity`, docs/orchestrator.md) adds one no-grad forward of the 32-token probe on the
trainer when it publishes policy n (`probe_time_s`) and one prompt-logprobs request per inference server after the
orchestrator loads it (`policy/probe_time_s`). This runs `tidal grpo` on the chosen model (default: the bundled
one, the default example's settings: merged reloads and on-policy on a CPU machine) for `--steps` steps and
reports, from its metrics.jsonl, the median of each side's time and their sum as a share of the median
`step_time_s` (step 1, which waits for vLLM's start, left out); the run also shows `policy/probe_gap` every step.

Writes `bench/POLICY_CHECK.md`. Usage: `python bench/policy_check.py [--model tidal:tiny-reverse] [--steps 8]`.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "scripts"))
import harness  # noqa: E402 - the benches' and checks' one harness (tidal.procs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tidal:tiny-reverse")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=str(REPO / "bench" / "POLICY_CHECK.md"))
    args = ap.parse_args()

    from tidal.monitor.metrics import read_metrics

    run_dir = Path(tempfile.mkdtemp(prefix="tidal-policy-check-")) / "run"
    cmd = [sys.executable, "-m", "tidal.cli", "grpo", "--model", args.model, "--output-dir", str(run_dir),
           "--infer.port", str(harness.free_port()), "--orch.max_steps", str(args.steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        print(done.stdout[-4000:], done.stderr[-4000:], sep="\n")
        return done.returncode
    rows = read_metrics(run_dir / "metrics.jsonl")[1:]  # step 1 waits for vLLM's start
    step = statistics.median(r["step_time_s"] for r in rows)
    trainer = statistics.median(r["probe_time_s"] for r in rows)
    orch = statistics.median(r["policy/probe_time_s"] for r in rows)
    gaps = [r["policy/probe_gap"] for r in read_metrics(run_dir / "metrics.jsonl")]
    lines = ["# Policy identity check: its cost beside a training step", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {platform.machine()} (cpu), model `{args.model}`, "
             f"`tidal grpo` with the default example's settings, {args.steps} steps (medians over steps 2-"
             f"{args.steps}); command: `python bench/policy_check.py {' '.join(sys.argv[1:])}`.", "",
             "| part | median (s) | share of a step |", "|---|---|---|",
             f"| step (`step_time_s`) | {step:.3f} | 1 |",
             f"| trainer: probe forward (`probe_time_s`) | {trainer:.4f} | {trainer / step:.2%} |",
             f"| orchestrator: probe through vLLM (`policy/probe_time_s`) | {orch:.4f} | {orch / step:.2%} |",
             f"| the check, both sides | {trainer + orch:.4f} | {(trainer + orch) / step:.2%} |", "",
             f"`policy/probe_gap` per step: {', '.join(f'{g:.2g}' for g in gaps)} (float32 tolerance 0.01)."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
