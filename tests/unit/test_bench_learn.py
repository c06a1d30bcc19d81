"""bench/learn.py's arithmetic on run curves (the goal lines of bench/LEARN.md), on hand-made curves."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
spec = importlib.util.spec_from_file_location("bench_learn", BENCH / "learn.py")
assert spec is not None and spec.loader is not None
learn = importlib.util.module_from_spec(spec)
spec.loader.exec_module(learn)


def run(framework: str, rewards: list[float], step_s: float, start: float, total: float) -> dict:
    return {"framework": framework, "seed": 0, "total_s": total,
            "curve": [(start + i * step_s, (i + 1) * 64, r) for i, r in enumerate(rewards)]}


def test_time_to_reach_uses_a_running_mean():
    r = run("tidal", [0.0, 0.6, 0.0, 0.6, 0.6, 0.6], 10.0, 50.0, 120.0)
    # running means of 3: 0.0, 0.3, 0.2, 0.4, 0.4, 0.6 -> 0.5 first reached at step 6 (t = 50 + 5 x 10)
    assert learn.time_to_reach(r, 0.5) == 100.0
    assert learn.time_to_reach(r, 0.7) is None
    assert abs(learn.final_reward(r, last=2) - 0.6) < 1e-12


def test_goal_lines_compare_with_trls_final_reward():
    trl = run("TRL", [0.1, 0.2, 0.3, 0.3, 0.3], 100.0, 60.0, 600.0)
    tidal = run("tidal", [0.1, 0.3, 0.3, 0.4, 0.4], 10.0, 40.0, 100.0)
    lines = learn.goal_lines([tidal, trl])
    assert "0.240 after 600 s" in lines[0]
    # TRL's target 0.24; tidal's running means 0.1, 0.2, 0.233, 0.333 -> step 4 at t = 40 + 3 x 10 = 70 s
    assert "reached it after 70 s (0.12 of TRL's time)" in lines[1]
    flat = run("TRL", [0.0, 0.0], 100.0, 60.0, 300.0)
    assert "no time comparison" in learn.goal_lines([tidal, flat])[-1]
    assert "no comparison" in learn.goal_lines([tidal])[0]
