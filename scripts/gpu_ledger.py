"""The GPU ledger: every GPU claim of tidal as one row of `bench/gpu_ledger.json`, rendered to `bench/GPU-LEDGER.md`.

A row says what it proves, the command that proves it, its budget and last measured cost in seconds, its last result
(`pass`, `fail` or `never run`), and for a run: the device, the commit, the date, the key figure and where the full
table lives. Docs that state a GPU fact name the row (`` `ledger:ID` ``); tests/unit/test_gpu_ledger.py checks that
every named row exists, that the docs call nothing verified on a GPU whose row has not passed, and that the
committed markdown is this module's rendering of the json.

Adding a claim is adding one object to `rows` (fields: `FIELDS`; `lease: false` when `make gpu-lease` cannot run it
on one lent GPU, with the reason in `note`). `make gpu-lease` (scripts/gpu_lease.py) runs rows and writes updated
ones to its output directory; `python3 scripts/gpu_ledger.py merge OUT/gpu_ledger_rows.json` folds them in here and
re-renders the markdown; `python3 scripts/gpu_ledger.py render` re-renders after a hand edit, `check` only compares.

Standard library only: it runs with the GPU kit's python3, without .venv.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LEDGER = REPO / "bench" / "gpu_ledger.json"
MARKDOWN = REPO / "bench" / "GPU-LEDGER.md"
RESULTS = ("pass", "fail", "never run")
FIELDS = {
    "id": "the row's name, cited in docs as `ledger:ID`",
    "what": "the claim the row proves when it passes",
    "command": "what proves it, run from the repository root with the GPU kit's python3 (empty: not written yet)",
    "budget_s": "seconds `make gpu-lease` gives it before it kills the row's process group",
    "lease": "whether `make gpu-lease` may run it on one lent GPU (false: the reason is in `note`)",
    "needs": "what must be carried, stashed or installed beyond the kit: trl, tinker, sglang, smollm2",
    "priority": "order among rows of the same result in a lease (lower first; the issue's first-lease order)",
    "result": "the last result: pass, fail or never run",
    "measured_s": "seconds the last run took (null: never run)",
    "device": "the card of the last run",
    "commit": "the commit the last run ran (or recorded it, where the docs give only that)",
    "date": "the day of the last run (UTC, YYYY-MM-DD)",
    "figure": "the key figure of the last run, or why it failed",
    "table": "where the full table of the last run lives",
    "note": "anything a reader of the row must know (why not leasable, what a past run showed)",
}
NEEDS = ("trl", "tinker", "sglang", "smollm2")


class LedgerError(ValueError):
    """The ledger file is malformed: the message names the row and the field."""


def load(path: Path = LEDGER) -> list[dict[str, Any]]:
    """The rows of `path`, validated (`validate`)."""
    data = json.loads(path.read_text())
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise LedgerError(f"{path}: expected an object with a `rows` list")
    validate(rows, str(path))
    return rows


def validate(rows: list[dict[str, Any]], where: str = "ledger") -> None:
    """Every field present and typed, ids unique, a run's device/commit/date set; `LedgerError` naming what."""
    seen: set[str] = set()
    for i, row in enumerate(rows):
        name = f"{where} row {i} ({row.get('id', '?')})"
        if set(row) != set(FIELDS):
            raise LedgerError(f"{name}: fields {sorted(set(row) ^ set(FIELDS))} missing or unknown; "
                              f"valid: {list(FIELDS)}")
        if not isinstance(row["id"], str) or not row["id"] or row["id"] in seen:
            raise LedgerError(f"{name}: id must be a unique non-empty string")
        seen.add(row["id"])
        if row["result"] not in RESULTS:
            raise LedgerError(f"{name}: result {row['result']!r} is not one of {RESULTS}")
        if not isinstance(row["budget_s"], (int, float)) or row["budget_s"] <= 0:
            raise LedgerError(f"{name}: budget_s must be a positive number of seconds")
        if not isinstance(row["lease"], bool) or (row["lease"] and not row["command"]):
            raise LedgerError(f"{name}: lease must be true or false, and a leasable row needs a command")
        if not row["lease"] and not row["note"]:
            raise LedgerError(f"{name}: a row gpu-lease cannot run says why in `note`")
        if unknown := [n for n in row["needs"] if n not in NEEDS]:
            raise LedgerError(f"{name}: needs {unknown} unknown; valid: {list(NEEDS)}")
        if row["result"] != "never run" and not all(row[k] for k in ("device", "date", "figure")):
            raise LedgerError(f"{name}: a {row['result']} row needs device, date and figure")


def dump(rows: list[dict[str, Any]], path: Path = LEDGER) -> None:
    """Write `rows` (one object per row, fields in `FIELDS` order) to `path` through a temp file and a rename."""
    validate(rows, str(path))
    body = ",\n".join("  " + json.dumps({k: row[k] for k in FIELDS}, ensure_ascii=False) for row in rows)
    tmp = path.with_suffix(".tmp")
    tmp.write_text('{\n "rows": [\n' + body + "\n ]\n}\n")
    tmp.replace(path)


def _cell(value: Any) -> str:
    text = "" if value is None else (", ".join(value) if isinstance(value, list) else str(value))
    return text.replace("|", "\\|").replace("\n", " ")


def render(rows: list[dict[str, Any]]) -> str:
    """bench/GPU-LEDGER.md: counts, then one table line per row in the ledger's order."""
    count = {r: sum(1 for row in rows if row["result"] == r) for r in RESULTS}
    lines = ["# GPU ledger", "",
             "Generated from `bench/gpu_ledger.json` by `python3 scripts/gpu_ledger.py render` (do not edit by hand; "
             "tests/unit/test_gpu_ledger.py checks it). One row per GPU claim; docs cite a row as `ledger:ID`. "
             "`make gpu-lease` runs the least proven rows first (scripts/gpu_lease.py; `--dry-run` shows its plan).",
             "", f"{len(rows)} rows: {count['pass']} pass, {count['fail']} fail, {count['never run']} never run.", "",
             "| id | result | what it proves | command | budget s | measured s | device | commit | date | key figure "
             "| table | note |", "|" + "---|" * 12]
    for row in rows:
        command = f"`{row['command']}`" if row["command"] else "(none yet)"
        lease = "" if row["lease"] else "not leasable: "
        needs = f" (needs {', '.join(row['needs'])})" if row["needs"] else ""
        cells = [row["id"], f"**{row['result']}**" if row["result"] != "never run" else row["result"], row["what"],
                 command + needs, row["budget_s"], row["measured_s"], row["device"], row["commit"], row["date"],
                 row["figure"], row["table"], (lease + (row["note"] or "")).strip()]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def merge(rows: list[dict[str, Any]], updates: list[dict[str, Any]], commit: str | None = None) -> list[str]:
    """Fold a lease's updated rows into `rows` in place (matched by id; a result of `never run` changes nothing);
    `commit` fills a run's missing commit. Returns the ids changed; `LedgerError` for an id not in the ledger."""
    by_id = {row["id"]: row for row in rows}
    changed = []
    for upd in updates:
        if upd.get("id") not in by_id:
            raise LedgerError(f"lease row {upd.get('id')!r} is not in the ledger; known: {sorted(by_id)}")
        if upd.get("result") not in ("pass", "fail"):
            continue
        row = by_id[upd["id"]]
        for key in ("result", "measured_s", "device", "commit", "date", "figure", "table"):
            row[key] = upd.get(key)
        if not row["commit"]:
            row["commit"] = commit
        changed.append(row["id"])
    validate(rows)
    return changed


def head_commit() -> str | None:
    """The checkout's short HEAD, or None where there is no git (the GPU machine's copy of the tree)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10)
    except OSError:
        return None
    return out.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("render", help="write bench/GPU-LEDGER.md from bench/gpu_ledger.json")
    sub.add_parser("check", help="exit 1 when bench/GPU-LEDGER.md is not the json's rendering")
    mp = sub.add_parser("merge", help="fold a lease's gpu_ledger_rows.json into the ledger, then render")
    mp.add_argument("rows", help="the lease's OUT/gpu_ledger_rows.json")
    mp.add_argument("--commit", default=None, help="the commit the lease ran, where its rows lack one (default HEAD)")
    args = ap.parse_args(argv)
    try:
        rows = load()
        if args.cmd == "check":
            if MARKDOWN.read_text() != render(rows):
                print(f"{MARKDOWN} is not the rendering of {LEDGER}: run python3 scripts/gpu_ledger.py render")
                return 1
            return 0
        if args.cmd == "merge":
            updates = json.loads(Path(args.rows).read_text())["rows"]
            changed = merge(rows, updates, args.commit or head_commit())
            dump(rows)
            print(f"merged {len(changed)} rows: {', '.join(changed) or 'none'}")
    except (LedgerError, OSError, json.JSONDecodeError, KeyError) as exc:
        print(f"gpu_ledger: {exc}", file=sys.stderr)
        return 2
    tmp = MARKDOWN.with_suffix(".tmp")
    tmp.write_text(render(rows))
    tmp.replace(MARKDOWN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
