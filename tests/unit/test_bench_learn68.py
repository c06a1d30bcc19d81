"""bench/learn_68.py's arithmetic: samples generated under dynamic sampling (dropped groups counted, top-ups not
counted twice) and the reward read at equal samples trained / generated / equal time, on hand-made runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
spec = importlib.util.spec_from_file_location("bench_learn_68", BENCH / "learn_68.py")
assert spec is not None and spec.loader is not None
learn68 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(learn68)


def run(rewards: list[float], rows: list[dict[str, float]] | None = None, step_s: float = 10.0) -> dict:
    return {"framework": "tidal", "arm": "a", "seed": 0, "adapter": "x", "rows": rows or [],
            "workload": {"prompts": 8, "generations": 8},
            "curve": [(30.0 + (i + 1) * step_s, (i + 1) * 64, r) for i, r in enumerate(rewards)]}


def test_generated_counts_dropped_groups_and_not_the_top_up_twice():
    rows = [{"buffer/dropped_groups": 0.0, "buffer/filled_with_dropped": 0.0},   # 8 groups, all kept
            {"buffer/dropped_groups": 3.0, "buffer/filled_with_dropped": 0.0},   # 3 dropped, replaced: 11 sampled
            {"buffer/dropped_groups": 5.0, "buffer/filled_with_dropped": 2.0}]   # 5 dropped, 2 of them filled: 11
    r = run([0.1, 0.2, 0.3], rows)
    assert learn68.generated(r) == [64, 64 + 88, 64 + 88 + 88]
    assert learn68.generated(run([0.1, 0.2])) == [64, 128], "no buffer metrics (TRL): every sample trained"


def test_reward_at_reads_the_last_three_steps_done_by_x():
    r = run([0.0, 0.3, 0.6, 0.9], [{"buffer/dropped_groups": 8.0}] * 4)  # 16 groups sampled a step
    assert abs(learn68.reward_at(r, 128, "trained") - 0.15) < 1e-12
    assert abs(learn68.reward_at(r, 256, "generated") - 0.15) < 1e-12  # 2 steps of 128 generated
    assert abs(learn68.reward_at(r, 61.0, "time") - 0.3) < 1e-12  # steps done at 40, 50, 60 s
    assert abs(learn68.reward_at(r, 70.0, "time") - 0.6) < 1e-12  # the last 3 of 4
    assert learn68.reward_at(r, 39.0, "time") != learn68.reward_at(r, 39.0, "time")  # nan: no step done yet
