"""The learning-bench figures README.md and docs quote, computed from the per-run rows of the committed bench file.

bench/learn.py writes bench/LEARN*.md with one row per (mode, seed) run: its s/step and total seconds. The prose
around them (README, docs/performance.md, the on-policy notice of `tidal grpo`) quotes ratios of those rows; this
prints them from the file, so a quoted figure can be checked against its source (tests/unit/test_bench_figures.py
does): per seed, one mode's total against another's (`longer`: a / b - 1; `sooner`: 1 - b / a), and TRL's time
over tidal's per step and per run for every seed both ran. Standard library only; rounding as printed.

    python3 scripts/bench_figures.py bench/LEARN.md bench/LEARN-SEEDS.md
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Row:
    """One run of the bench's first table."""

    mode: str
    """`tidal`, `tidal-async1`, `trl`, ... (a `(reused ...)` note dropped)."""
    seed: int
    step_s: float
    """Seconds per step."""
    total_s: float
    """The whole run, start-up included."""


def rows(path: Path) -> list[Row]:
    """The per-run rows of `path` (the first table whose header starts `| mode | seed | first step done`)."""
    out: list[Row] = []
    header: list[str] | None = None
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            if cells[:3] == ["mode", "seed", "first step done (s)"]:
                header = cells
            continue
        if set(line.strip()) <= set("|-"):
            continue
        if not line.startswith("|"):
            break
        row = dict(zip(header, cells, strict=True))
        out.append(Row(re.sub(r"\s*\(.*\)$", "", row["mode"]), int(row["seed"]), float(row["s/step"]),
                       float(row["total (s)"])))
    if not out:
        raise ValueError(f"{path}: no per-run table (| mode | seed | first step done (s) | ...)")
    return out


def by_seed(runs: list[Row], mode: str) -> dict[int, Row]:
    return {r.seed: r for r in runs if r.mode == mode}


def percent_range(values: list[float]) -> str:
    """`lo-hi%` of fractions, rounded to whole percent."""
    lo, hi = round(min(values) * 100), round(max(values) * 100)
    return f"{lo}%" if lo == hi else f"{lo}-{hi}%"


def mode_lines(runs: list[Row], a: str, b: str) -> list[str]:
    """Per seed, mode `a`'s total against mode `b`'s, and the range over seeds."""
    ra, rb = by_seed(runs, a), by_seed(runs, b)
    seeds = sorted(set(ra) & set(rb))
    if not seeds:
        return []
    longer = [ra[s].total_s / rb[s].total_s - 1 for s in seeds]
    sooner = [1 - rb[s].total_s / ra[s].total_s for s in seeds]
    per = ", ".join(f"seed {s} {ra[s].total_s:.0f}/{rb[s].total_s:.0f} s" for s in seeds)
    return [f"{a} vs {b}, whole run per seed: {per}: {a} {percent_range(longer)} longer, {b} "
            f"{percent_range(sooner)} sooner"]


def trl_lines(runs: list[Row], tidal: str = "tidal") -> list[str]:
    """TRL's time over tidal's, per step and per run, for each seed both ran."""
    trl, ours = by_seed(runs, "trl"), by_seed(runs, tidal)
    return [f"TRL / {tidal} seed {s}: per step {trl[s].step_s / ours[s].step_s:.2f}x, whole run "
            f"{trl[s].total_s / ours[s].total_s:.2f}x" for s in sorted(set(trl) & set(ours))]


def figures(path: Path) -> list[str]:
    """Every figure line of `path`."""
    runs = rows(path)
    return [*mode_lines(runs, "tidal", "tidal-async1"), *trl_lines(runs), *trl_lines(runs, "tidal-async1")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="bench/LEARN*.md files")
    for path in ap.parse_args(argv).files:
        for line in figures(path):
            print(f"{path}: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
