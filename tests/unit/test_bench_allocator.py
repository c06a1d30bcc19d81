"""bench/allocator.py's table: per allocator and step the median over the rounds and the ratio to glibc's, on
fresh random measurements (float64 reference: numpy's median), and a first step that differs between processes
flagged."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parents[2] / "bench"
spec = importlib.util.spec_from_file_location("bench_allocator", BENCH / "allocator.py")
assert spec is not None and spec.loader is not None
allocator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(allocator)


def test_the_table_is_the_medians_and_their_ratio():
    rng = np.random.default_rng()
    walls = rng.uniform(5, 20, size=(2, 3, 2))  # kind, round, step
    runs = [{"kind": k, "first": {"loss": 0.5}, "steps": [
        {"wall_s": walls[i, r, s], "user_s": 1.0, "sys_s": 0.5, "faults": 1000} for s in range(2)]}
            for r in range(3) for i, k in enumerate(("system", "tcmalloc"))]
    text = "\n".join(allocator.report(runs, 2))
    for s in range(2):
        ratio = np.median(walls[1, :, s]) / np.median(walls[0, :, s])
        assert f"| tcmalloc | {s + 1} | {np.median(walls[1, :, s]):.2f} |" in text
        assert f"| {ratio:.2f} |" in text
    assert "the same in every process" in text
    runs[-1]["first"] = {"loss": 0.25}
    assert "NOT the same in every process" in "\n".join(allocator.report(runs, 2))
