"""The end of a run: from the trainer's last step to `tidal grpo`'s exit, with the fast exit (`tidal.procs.exit`: the
trainer and the launcher skip the interpreter's module teardown) and without (`TIDAL_FAST_EXIT=0`, the full shutdown
as before), alternating in one invocation on the bundled example; writes bench/EXIT-TAIL.md.

    /work/notes/heavy python bench/exit_tail.py --rounds 3 --steps 5

Each run's output lines are timed as they arrive: `last step` (the trainer's `step N/N` line), `report` (its `run
report` line: the last thing the trainer does), `complete` (the launcher's `run complete`, once it saw the trainer
exit) and `exit` (the command's exit, after vLLM's stop). The tail is `exit - last step`.

`--baseline-src DIR` compares two versions of tidal instead, both with the fast exit: DIR (another checkout's `src`,
e.g. a git worktree of an earlier commit, first on the children's PYTHONPATH) against this checkout's, alternating.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import harness  # noqa: E402 - scripts/harness.py: children through tidal.procs

BUDGET_S = 600.0
"""Longest one run may take."""
MARKS = {"last step": None, "report": re.compile(r"\[train\].*run report: "),
         "complete": re.compile(r"\[tidal\] run complete")}


def one(env: dict[str, str], steps: int, work: Path) -> dict[str, float]:
    """One `tidal grpo` of the bundled example (a `harness` child, environment `env`); the seconds since its start of
    each mark (module doc)."""
    cmd = [sys.executable, "-m", "tidal.cli", "grpo", "--output-dir", str(work), "--orch.max_steps", str(steps)]
    last = re.compile(rf"\[train\].*step {steps}/{steps} ")
    got: dict[str, float] = {}
    t0 = time.monotonic()

    def on_line(line: str) -> None:
        now = time.monotonic() - t0
        if last.search(line):
            got["last step"] = now
        for name, pattern in MARKS.items():
            if pattern is not None and pattern.search(line):
                got[name] = now

    child = harness.start("grpo", cmd, work.parent / f"{work.name}.log", env, on_line=on_line)
    try:
        code = child.wait(timeout=BUDGET_S)
        got["exit"] = time.monotonic() - t0
    finally:
        harness.stop(child)
    child.tail()  # the output pump has read every line
    if code != 0:
        raise SystemExit(f"exit_tail: {' '.join(cmd)} exited with {code}; log {work.parent / f'{work.name}.log'}")
    got["load"] = os.getloadavg()[0]
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "bench" / "EXIT-TAIL.md"))
    ap.add_argument("--baseline-src", help="another checkout's src: compare it with this one's (module doc)")
    args = ap.parse_args()
    if args.baseline_src:
        src = Path(args.baseline_src).resolve()
        if not (src / "tidal" / "cli.py").is_file():
            raise SystemExit(f"exit_tail: --baseline-src {src} holds no tidal package")
        variants = {"baseline": harness.child_env(src, TIDAL_FAST_EXIT="1"),
                    "this checkout": harness.child_env(TIDAL_FAST_EXIT="1")}
    else:
        variants = {"full shutdown": harness.child_env(TIDAL_FAST_EXIT="0"),
                    "fast exit": harness.child_env(TIDAL_FAST_EXIT="1")}
    rows: list[tuple[int, str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="exit-tail-") as tmp:
        for r in range(1, args.rounds + 1):
            for k, (name, env) in enumerate(variants.items()):
                got = one(env, args.steps, Path(tmp) / f"{r}-{k}")
                rows.append((r, name, got))
                print(f"round {r} {name}: tail {got['exit'] - got['last step']:.2f} s, whole {got['exit']:.1f} s",
                      flush=True)
    base, new = variants
    what = (f"this checkout's src against {args.baseline_src}'s, both with the fast exit" if args.baseline_src
            else "with and without the fast exit")
    flag = f" --baseline-src {args.baseline_src}" if args.baseline_src else ""
    lines = [f"# The end of a run, {what} (bench/exit_tail.py)", "",
             f"Written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: `python bench/exit_tail.py --rounds "
             f"{args.rounds} --steps {args.steps}{flag}`, the bundled example ({args.steps} steps), the two variants "
             "alternating; seconds since the command's start.", "",
             "| round | variant | last step | report | complete | exit | tail (exit - last step) | report -> complete "
             "| complete -> exit | whole | load 1-min |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r, name, g in rows:
        lines.append(f"| {r} | {name} | {g['last step']:.2f} | {g['report']:.2f} | {g['complete']:.2f} | "
                     f"{g['exit']:.2f} | **{g['exit'] - g['last step']:.2f}** | {g['complete'] - g['report']:.2f} | "
                     f"{g['exit'] - g['complete']:.2f} | {g['exit']:.1f} | {g['load']:.2f} |")
    tails = {name: [g["exit"] - g["last step"] for _, n, g in rows if n == name] for name in variants}
    gaps = {name: [g["complete"] - g["report"] for _, n, g in rows if n == name] for name in tails}
    reports = {name: [g["report"] - g["last step"] for _, n, g in rows if n == name] for name in tails}
    med = {name: statistics.median(v) for name, v in tails.items()}
    lines += ["", f"Median tail: {base} {med[base]:.2f} s, {new} {med[new]:.2f} s (ratio {med[new] / med[base]:.2f}); "
              f"the trainer's last step to its report line: {statistics.median(reports[base]):.2f} s against "
              f"{statistics.median(reports[new]):.2f} s; the report line to the launcher's `run complete` (the "
              f"trainer's exit): {statistics.median(gaps[base]):.2f} s against {statistics.median(gaps[new]):.2f} s.",
              ""]
    Path(args.out).write_text("\n".join(lines))
    print(f"exit_tail: wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
