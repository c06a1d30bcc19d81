"""Where the time of `tidal grpo` runs went: the first step and the end of each run, from their own files.

For each run directory (a `tidal grpo --output-dir`, e.g. the ones bench/vllm_startup.py prints after each row)
it reads `launcher.log` (the launcher's `inference ready after X s (phases)` and `first step done after Y s
(milestones)` lines) and `metrics.jsonl` (the per-step accounting that bench/step_overhead.py defines: rollout,
train, probe, `timing/publish_s`, `timing/policy_ready_s`, `timing/assemble_s`, `timing/handoff_s`, other) and
prints one markdown table of step 1's parts (its step_time_s counts from the batch's arrival, so its rollout and
the wait for vLLM's start sit outside it: no "other") and one of the medians over the last `--last` steps. Nothing
is run.

    python bench/step_accounting.py /tmp/startbench/inv2/grpo-default-* /tmp/startbench/inv2/grpo-pool-*
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_overhead import PARTS, accounting  # noqa: E402 - the one definition of a step's parts

SHORT = {"rollout_time_s": "rollout", "train_time_s": "train", "probe_time_s": "probe", "timing/publish_s": "publish",
         "timing/policy_ready_s": "policy_ready", "timing/assemble_s": "assemble", "timing/handoff_s": "handoff"}


def launcher_lines(run: Path) -> tuple[str, str]:
    """The launcher's start-up phases and first-step milestones (empty where the log lacks them)."""
    text = (run / "launcher.log").read_text(errors="replace") if (run / "launcher.log").exists() else ""
    ready = re.search(r"inference ready after ([0-9.]+) s(?: \(([^)]*) s\))?", text)
    first = re.search(r"first step done after ([0-9.]+) s \(([^)]*) s since vLLM was started\)", text)
    phases = f"ready {ready.group(1)} ({ready.group(2) or ''})" if ready else "-"
    return phases, (f"first step {first.group(1)} ({first.group(2)})" if first else "-")


def tables(runs: list[Path], last: int) -> str:
    head = "| run | step_time_s | " + " | ".join(SHORT[p] for p in PARTS) + " | other | wait_time_s |"
    sep = "|" + "---|" * (len(PARTS) + 4)
    one, end, starts = [head, sep], [head, sep], []
    for run in runs:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        first, tail = accounting(rows[:1], 0), accounting(rows[-last:], 0)
        name = run.name.rsplit("-", 1)[0]
        one.append(f"| {name} | " + " | ".join(f"{first[k][0]:.2f}" for k in ["step_time_s", *PARTS])
                   + f" | - | {float(rows[0].get('wait_time_s') or 0):.2f} |")  # step 1's clock starts at its batch
        end.append(f"| {name} (steps {rows[-last:][0]['step']}-{rows[-1]['step']}) | "
                   + " | ".join(f"{statistics.median(tail[k]):.2f}" for k in ["step_time_s", *PARTS, "other"])
                   + f" | {statistics.median(float(r.get('wait_time_s') or 0) for r in rows[-last:]):.2f} |")
        starts.append(f"- {name}: " + "; ".join(launcher_lines(run)))
    return ("Step 1 (s):\n\n" + "\n".join(one) + f"\n\nMedian of the last {last} steps (s):\n\n" + "\n".join(end)
            + "\n\nStart-up (the launcher's lines, s):\n\n" + "\n".join(starts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="`tidal grpo` output directories")
    ap.add_argument("--last", type=int, default=5, help="steps at the end of each run for the second table")
    args = ap.parse_args()
    print(tables(args.runs, args.last))


if __name__ == "__main__":
    main()
