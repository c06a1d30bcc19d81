"""`tidal eval`'s report: a table on the terminal, the JSON file, a few completions per row, and each row's paired
difference to the first row (the same examples, so per-example differences resampled together: a tighter and honest
comparison than two separate intervals).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from tidal.evaluate.run import EvalResult, Row
from tidal.monitor.eval_metrics import bootstrap
from tidal.paths import write_atomic

PAIRED = {"greedy": ("accuracy", "reward/mean"), "sampled": ("pass@1", "reward/mean")}
"""The keys compared with the first row, per kind of completions."""


def paired(row: Row, first: Row, kind: str, key: str, seed: int = 0) -> dict[str, float] | None:
    """`row` minus `first` on `key` (`accuracy`: the first completion correct; `pass@1`: the share of correct
    completions; `reward/mean`), per example, with a 95% bootstrap interval; None when either lacks `kind`."""
    if row is first or kind not in row.rewards or kind not in first.rewards:
        return None
    a, b = np.asarray(row.rewards[kind], dtype=np.float64), np.asarray(first.rewards[kind], dtype=np.float64)
    if key == "reward/mean":
        diff = a.mean(1) - b.mean(1)
    else:
        a, b = (a >= 1.0).astype(np.float64), (b >= 1.0).astype(np.float64)
        diff = a[:, 0] - b[:, 0] if key == "accuracy" else a.mean(1) - b.mean(1)
    lo, hi = bootstrap(diff, seed=seed)
    return {"delta": float(diff.mean()), "delta_lo": lo, "delta_hi": hi}


def as_json(result: EvalResult) -> dict[str, Any]:
    """The report as one JSON document (rows with their metrics, intervals, paired deltas and sample completions)."""
    first = result.rows[0]
    rows = []
    for r in result.rows:
        d = asdict(r)  # with the per-example rewards: rows can be compared pairwise later
        d["vs_first"] = {f"{kind}/{key}": delta for kind, keys in PAIRED.items() for key in keys
                         if (delta := paired(r, first, kind, key)) is not None}
        rows.append(d)
    return {"env": result.env, "examples": result.examples, "serve": result.serve, "vllm_ready_s": result.ready_s,
            "sample_s": result.sample_s, "rows": rows, "config": result.config}


def write_json(result: EvalResult, path: Path) -> None:
    write_atomic(path, json.dumps(as_json(result), indent=1))


def interval(m: dict[str, float], key: str, digits: int = 3) -> str:
    return f"{m[key]:.{digits}f} [{m[key + '_lo']:.{digits}f}, {m[key + '_hi']:.{digits}f}]"


def table_rows(result: EvalResult) -> tuple[list[str], list[list[str]]]:
    """Header and cells of the terminal table."""
    kinds = [k for k in ("greedy", "sampled") if any(getattr(r, k) for r in result.rows)]
    head = ["model"]
    if "greedy" in kinds:
        head += ["greedy accuracy", "vs first", "greedy reward"]
    sampled = next((r.sampled for r in result.rows if r.sampled), None)
    ks = [k for k in (sampled or {}) if k.startswith("pass@") and "_" not in k]
    if sampled:
        head += ["sampled reward", *ks]
    head += ["mean length", "cut"]
    cells = []
    for r in result.rows:
        line = [r.label]
        if "greedy" in kinds and r.greedy:
            d = paired(r, result.rows[0], "greedy", "accuracy")
            line += [interval(r.greedy, "accuracy"),
                     "" if d is None else f"{d['delta']:+.3f} [{d['delta_lo']:+.3f}, {d['delta_hi']:+.3f}]",
                     interval(r.greedy, "reward/mean")]
        if sampled and r.sampled:
            line += [interval(r.sampled, "reward/mean"), *(f"{r.sampled[k]:.3f}" for k in ks)]
        m = r.greedy or r.sampled or {}
        line += [f"{m.get('completion_len/mean', float('nan')):.1f}", f"{m.get('cut/share', float('nan')):.3f}"]
        cells.append(line)
    return head, cells


def print_report(result: EvalResult, json_path: Path | None) -> None:
    """The table (95% intervals in brackets), a few completions per row, and where the JSON went."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    head, cells = table_rows(result)
    table = Table(title=f"tidal eval: {result.env}, {result.examples} examples ({result.serve}; vLLM ready after "
                        f"{result.ready_s:.0f} s, scored in {result.sample_s:.1f} s)")
    for h in head:
        table.add_column(h)
    for line in cells:
        table.add_row(*line)
    console.print(table)
    for r in result.rows:
        for s in r.samples:
            text = s["completion"].replace("\n", " ")[:160]
            console.print(f"  {r.label} #{s['example']} ({s['kind']}, reward {s['reward']:.2f}): "
                          f"{s['prompt'][:60]!r} -> {text!r}", markup=False)
    if json_path is not None:
        console.print(f"[tidal eval] report: {json_path}", markup=False)
