"""`make gpu-lease`: spend one GPU lease on what the GPU ledger (bench/gpu_ledger.json) has proven least.

GPU machines come for about 15 minutes at a time, start and kit included. This script reads the ledger, orders its
leasable rows (`order`: the `smoke` row first, so a broken kit fails in seconds and stops the lease; then rows never
run, then failed ones, each by the ledger's `priority`; then passed rows, the oldest first), keeps those that fit
`--deadline` seconds (`plan`: each row's `budget_s`; a row whose kit is missing here is left out, saying which),
and runs them one by one, each a child of scripts/harness.py (`tidal.procs`: its own process group, killed as a
whole at its budget).

A row passes when its command exits 0 within its budget, reports no failure and, for pytest, skips no test (a
skipped test proves nothing of the row's claim); a command may print
`LEDGER_RESULT {"status": ..., "figure": ...}` lines (scripts/gpu_check.py prints one per check: a check FAIL,
skipped or not reached is not a pass). A row not reached keeps its ledger result. Written to `--out` (default
`$OUT`, else a temp directory): `gpu_ledger_rows.json` (the updated rows: merge them here with
`python3 scripts/gpu_ledger.py merge OUT/gpu_ledger_rows.json`), `logs/ID.log`, `rows/ID/` (the row's `$OUT`: its
tables), `GPU-LEASE.md`. Exit 1 when a row failed, 2 for a malformed ledger or bad arguments; the last lines say
what the next lease will run.

On a GPU machine set up by the kit (no .venv): `source .gpu-kit/install.sh && make gpu-lease` (the Makefile uses
python3 where .venv is absent; carry `.gpu-kit/trl` for the TRL rows, `.gpu-kit/tinker` for `t`, `.gpu-kit/smollm2`
for `smollm2-135m`, whose GGUF parts s0 and s1 are stashed like the kit's: scripts/gpu_kit_smollm2.sh). Anywhere:
`make gpu-lease GPU_LEASE_ARGS="--dry-run --deadline 600"` prints the plan and runs nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "scripts"))
import gpu_ledger  # noqa: E402 - after the path: the ledger's reader and writer

LEASE_S = 900
"""Device time of one lease, everything included."""
MACHINE_START_S = 30
"""A fresh machine's start (../shared/gpu-kit/README.md: ~26-30 s on the H100 and H200)."""
KIT_S = 70
"""The kit's stash calls (~20 s) and install.sh (~40 s), with a margin."""
RETURN_S = 60
"""Stopping the last row, the files coming back and the idle wait before the machine is given back."""
PER_CALL_S = 600
"""The device tool's limit for one command: the lease is one command."""
STOP_MARGIN_S = 30
"""Seconds kept below `PER_CALL_S` to stop the last row's processes and write the output."""
DEFAULT_DEADLINE_S = min(LEASE_S - MACHINE_START_S - KIT_S - RETURN_S, PER_CALL_S - STOP_MARGIN_S)
SMOKE = "smoke"
RANK = {"never run": 1, "fail": 2, "pass": 3}


def order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The leasable rows, least proven first: `smoke`, then never run, then failed (each by `priority`, then the
    ledger's order), then passed, the oldest date first."""
    def key(item: tuple[int, dict[str, Any]]) -> tuple[int, str, int, int]:
        i, row = item
        if row["id"] == SMOKE:
            return (0, "", 0, i)
        rank = RANK[row["result"]]
        return (rank, row["date"] or "", 0, i) if rank == 3 else (rank, "", row["priority"], i)

    return [row for _, row in sorted(enumerate(rows), key=key) if row["lease"]]


@dataclass
class Plan:
    """What a lease runs (in order) within `deadline_s`, and what it leaves out and why."""

    deadline_s: float
    run: list[dict[str, Any]] = field(default_factory=list)
    left_out: list[tuple[dict[str, Any], str]] = field(default_factory=list)

    @property
    def planned_s(self) -> float:
        return float(sum(row["budget_s"] for row in self.run))


def plan(rows: list[dict[str, Any]], deadline_s: float, available: set[str] | None = None,
         only: set[str] | None = None) -> Plan:
    """The rows of `order` that fit `deadline_s` one after the other at their budgets (a row that does not fit is
    passed over for a shorter one after it); `available`: the needs met here (None: all); `only`: these ids."""
    out, left = Plan(deadline_s), deadline_s
    for row in order(rows):
        if only is not None and row["id"] not in only:
            continue
        missing = [n for n in row["needs"] if available is not None and n not in available]
        if missing:
            out.left_out.append((row, f"needs {', '.join(missing)}, not here"))
        elif row["budget_s"] > left:
            out.left_out.append((row, f"budget {row['budget_s']} s > {left:.0f} s left"))
        else:
            out.run.append(row)
            left -= row["budget_s"]
    return out


def describe(p: Plan, available: set[str] | None = None) -> list[str]:
    """The plan as lines: each row run with its budget, result so far and missing needs, then the total."""
    lines = []
    for i, row in enumerate(p.run, 1):
        missing = [n for n in row["needs"] if available is not None and n not in available]
        note = f" [needs {', '.join(missing)}: not here]" if missing else ""
        lines.append(f"  {i}. {row['id']} ({row['budget_s']} s, {row['result']}){note}: {row['command']}")
    lines.append(f"  = {p.planned_s:.0f} s of the {p.deadline_s:.0f} s deadline")
    return lines


def left_out_lines(p: Plan) -> list[str]:
    """The rows a plan leaves out, grouped by reason: `needs ...` one line each, the rows that do not fit on one."""
    no_fit = [row["id"] for row, why in p.left_out if why.startswith("budget")]
    lines = [f"  left out: {row['id']} ({why})" for row, why in p.left_out if not why.startswith("budget")]
    if no_fit:
        lines.append(f"  left out, not fitting what is left: {', '.join(no_fit)}")
    return lines


PYTEST_SUMMARY = re.compile(r"^=*\s*(no tests ran|\d+ (passed|failed|skipped|deselected|error)).* in [\d.]+s")
"""pytest's last line (`3 passed, 1 skipped in 2.1s`, `no tests ran in 0.1s`), with or without its `=` rule."""


def judge(code: int | None, text: str, budget_s: float) -> tuple[str, str]:
    """(status, figure) of a row's run: `code` None when it was stopped at its budget. Status `pass`, `fail` or
    `skipped` (a `LEDGER_RESULT` skipped / not reached and nothing failed, or a pytest run that skipped any of its
    tests, "1 passed, 3 skipped" included: the ledger keeps its result)."""
    reports = []
    for line in text.splitlines():
        if line.startswith("LEDGER_RESULT "):
            try:
                reports.append(json.loads(line.removeprefix("LEDGER_RESULT ")))
            except json.JSONDecodeError:
                reports.append({"status": "FAIL", "figure": f"unreadable: {line[:200]}"})
    last = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "(no output)")
    figure = "; ".join(str(r.get("figure", "")) for r in reports)[:600] or last[:300]
    if code is None:
        return "fail", f"stopped at its budget of {budget_s:.0f} s; {figure}"
    if any(str(r.get("status")).lower() == "fail" for r in reports):
        return "fail", figure
    summary = next((m for m in reversed(text.splitlines()) if PYTEST_SUMMARY.match(m.strip())), None)
    if summary is not None and code in (0, 5) and " passed" not in summary:
        return "skipped", f"pytest ran nothing: {summary.strip('= ')}"  # every test skipped, or none collected
    if summary is not None and code == 0 and re.search(r"\d+ skipped", summary):
        # a skipped test did not prove its part of the row's claim: not a pass (the ledger keeps its result)
        return "skipped", f"pytest skipped some of the row's tests: {summary.strip('= ')}"
    if code != 0:
        return "fail", f"exit {code}; {figure}"
    if any(str(r.get("status")).lower() != "pass" for r in reports):
        return "skipped", figure
    return "pass", figure


def device_name() -> str:
    """The first GPU's name and memory (nvidia-smi), else the CPU."""
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
        if out:
            name, _, mem = out[0].partition(",")
            return f"{name.strip()} ({mem.strip()})"
    import platform

    return f"CPU ({platform.machine()})"


SMOLLM2_SUMS = ".gpu-kit/smollm2/SHA256SUMS"
"""The SmolLM2 GGUF's parts as scripts/gpu_kit_smollm2.sh lists them (`sha256sum` lines: the file, then s0, s1)."""
STASH = Path("/tmp/stash")
"""Where `.gpu-kit/stash.sh` keeps the carried parts on the GPU machine."""


def smollm2_stashed(sums: Path = REPO / SMOLLM2_SUMS, stash: Path = STASH) -> bool:
    """Need `smollm2`: its listing was carried and every part it names (s0, s1, ...) is stashed."""
    if not sums.is_file():
        return False
    parts = [name for line in sums.read_text().splitlines()
             if re.fullmatch(r"s\d+", name := line.partition("  ")[2])]
    return bool(parts) and all((stash / p).is_file() for p in parts)


def available_needs() -> set[str]:
    """The needs of `gpu_ledger.NEEDS` met here: installed, or carried as the GPU kit's wheels; `smollm2`: the
    GGUF's parts stashed (`smollm2_stashed`)."""
    have = {"smollm2"} if smollm2_stashed() else set()
    for need, carried in (("trl", ".gpu-kit/trl"), ("tinker", ".gpu-kit/tinker"), ("sglang", None)):
        if importlib.util.find_spec(need) is not None or (carried and (REPO / carried).exists()):
            have.add(need)
    return have


def run_row(row: dict[str, Any], out: Path, left_s: float) -> tuple[str, str, float]:
    """Run one row (a `harness.start` child in the repository root, `OUT` = out/rows/ID, its output echoed),
    killed as a whole process group at min(its budget, `left_s`). Returns (status, figure, seconds)."""
    import harness

    budget = max(1.0, min(float(row["budget_s"]), left_s))
    argv = shlex.split(row["command"])
    if argv and argv[0] == "python3":
        argv[0] = sys.executable
    row_out, log = out / "rows" / row["id"], out / "logs" / f"{row['id']}.log"
    row_out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    child = harness.start(row["id"], argv, log, env=harness.child_env(OUT=str(row_out)), echo=True)
    try:
        code: int | None = child.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        harness.stop(child)
    child.tail()  # waits for the output pump to reach the end of the log
    seconds = round(time.monotonic() - started, 1)
    status, figure = judge(code, log.read_text(errors="replace") if log.exists() else "", budget)
    return status, figure, seconds


def run_plan(p: Plan, out: Path, commit: str | None) -> list[tuple[dict[str, Any], str]]:
    """Each planned row in turn within the deadline; a failed `smoke` stops the lease. Returns (row updated, status)."""
    end, device, done = time.monotonic() + p.deadline_s, device_name(), []
    for row in p.run:
        left = end - time.monotonic()
        if left < 10:
            break
        print(f"[gpu_lease] {row['id']} (budget {min(row['budget_s'], left):.0f} s): {row['command']}", flush=True)
        status, figure, seconds = run_row(row, out, left)
        print(f"[gpu_lease] {row['id']}: {status} in {seconds} s: {figure[:300]}", flush=True)
        new = dict(row)
        if status != "skipped":
            new.update(result=status, measured_s=seconds, device=device, commit=commit,
                       date=time.strftime("%Y-%m-%d", time.gmtime()), figure=figure)
        done.append((new, status))
        if row["id"] == SMOKE and status == "fail":
            print("[gpu_lease] the smoke row failed: the kit or the bundled run is broken, the lease stops here")
            break
    return done


def report(p: Plan, done: list[tuple[dict[str, Any], str]], after: Plan, device: str) -> str:
    """GPU-LEASE.md: the device, each row run with its status, seconds and figure, then the next lease's plan."""
    lines = ["# GPU lease (scripts/gpu_lease.py)", "",
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {device}; deadline {p.deadline_s:.0f} s, "
             f"{len(p.run)} rows planned, {len(done)} reached.", "",
             "| row | status | seconds | figure |", "|---|---|---|---|"]
    for row, status in done:
        lines.append(f"| {row['id']} | {status} | {row['measured_s']} | "
                     f"{gpu_ledger._cell(row['figure'])} |")
    reached = {row["id"] for row, _ in done}
    lines += [f"| {row['id']} | not reached (stays {row['result']}) |  |  |" for row in p.run
              if row["id"] not in reached]
    lines += ["", "Next lease:", *describe(after)]
    return "\n".join(lines) + "\n"


def write(out: Path, name: str, text: str) -> None:
    tmp = out / (name + ".tmp")
    tmp.write_text(text)
    tmp.replace(out / name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S,
                    help=f"seconds for all rows (default {DEFAULT_DEADLINE_S}: what {LEASE_S} s leave after the "
                         f"machine's start, the kit and the files' return, within one {PER_CALL_S} s command)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="output directory (default $OUT, else a temp dir)")
    ap.add_argument("--only", default=None, help="comma-separated row ids")
    ap.add_argument("--ledger", default=str(gpu_ledger.LEDGER), help="the ledger (default bench/gpu_ledger.json)")
    ap.add_argument("--commit", default=os.environ.get("TIDAL_COMMIT"),
                    help="the commit being run (default $TIDAL_COMMIT, else git's HEAD where git exists)")
    ap.add_argument("--allow-cpu", action="store_true", help="run rows although no GPU is visible (tests)")
    args = ap.parse_args(argv)
    if args.deadline <= 0:
        print(f"gpu_lease: --deadline must be positive seconds, not {args.deadline}", file=sys.stderr)
        return 2
    try:
        rows = gpu_ledger.load(Path(args.ledger))
    except (gpu_ledger.LedgerError, OSError, json.JSONDecodeError) as exc:
        print(f"gpu_lease: {exc}", file=sys.stderr)
        return 2
    only = set(args.only.split(",")) if args.only else None
    if only and (unknown := only - {r["id"] for r in rows}):
        print(f"gpu_lease: --only names rows not in {args.ledger}: {sorted(unknown)}", file=sys.stderr)
        return 2
    if args.dry_run:
        p = plan(rows, args.deadline, None, only)
        print(f"gpu-lease plan ({args.ledger}, deadline {args.deadline:.0f} s):", *describe(p, available_needs()),
              sep="\n")
        print(*left_out_lines(p), sep="\n")
        return 0
    if shutil.which("nvidia-smi") is None and not args.allow_cpu:
        print("gpu_lease: no GPU here (no nvidia-smi); --dry-run prints the plan", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="tidal-gpu-lease-"))
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(REPO)
    p = plan(rows, args.deadline, available_needs(), only)
    print(f"[gpu_lease] plan, deadline {args.deadline:.0f} s:", *describe(p), sep="\n", flush=True)
    done = run_plan(p, out, args.commit or gpu_ledger.head_commit())
    updated = {row["id"]: row for row, _ in done}
    after_rows = [updated.get(r["id"], r) for r in rows]
    write(out, "gpu_ledger_rows.json", json.dumps({"rows": [row for row, _ in done]}, indent=1) + "\n")
    after = plan(after_rows, args.deadline, None, only)
    write(out, "GPU-LEASE.md", report(p, done, after, device_name()))
    failed = [row["id"] for row, status in done if status == "fail"]
    print(f"[gpu_lease] {len(done)} of {len(p.run)} planned rows reached; failed: {', '.join(failed) or 'none'}; "
          f"output in {out} (merge: python3 scripts/gpu_ledger.py merge {out}/gpu_ledger_rows.json)")
    print("[gpu_lease] the next lease will run:", *describe(after), sep="\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
