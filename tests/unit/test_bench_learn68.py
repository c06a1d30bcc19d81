"""bench/learn_68.py's arithmetic: samples generated under dynamic sampling (dropped groups counted, top-ups not
counted twice) and the reward read at equal samples trained / generated / equal time, on hand-made runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

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


def test_generated_counts_the_extra_completions_of_extended_groups():
    rows = [{"extend/completions": 64.0}, {"extend/completions": 24.0, "buffer/dropped_groups": 1.0}, {}]
    assert learn68.generated(run([0.1, 0.2, 0.3], rows)) == [128, 128 + 64 + 24 + 8, 128 + 96 + 64]


def test_reward_at_reads_the_last_three_steps_done_by_x():
    r = run([0.0, 0.3, 0.6, 0.9], [{"buffer/dropped_groups": 8.0}] * 4)  # 16 groups sampled a step
    assert abs(learn68.reward_at(r, 128, "trained") - 0.15) < 1e-12
    assert abs(learn68.reward_at(r, 256, "generated") - 0.15) < 1e-12  # 2 steps of 128 generated
    assert abs(learn68.reward_at(r, 61.0, "time") - 0.3) < 1e-12  # steps done at 40, 50, 60 s
    assert abs(learn68.reward_at(r, 70.0, "time") - 0.6) < 1e-12  # the last 3 of 4
    assert learn68.reward_at(r, 39.0, "time") != learn68.reward_at(r, 39.0, "time")  # nan: no step done yet


def test_the_time_goal_marks_the_runs_that_reach_each_trl_seeds_final_reward_within_a_sixth():
    trl = {**run([0.0] * 10 + [0.5] * 5, step_s=60.0), "framework": "TRL", "arm": "trl", "total_s": 960.0}
    fast = {**run([0.1, 0.5, 0.5, 0.5, 0.5]), "seed": 0}  # 3-step running mean 0.5 at step 4: 70 s
    slow = {**run([0.1] * 15 + [0.5] * 3), "seed": 1}  # at step 18: 210 s, past 960 / 6 = 160 s
    never = {**run([0.1] * 5), "seed": 2}
    lines = learn68.time_goal([trl, fast, slow, never])
    row = next(ln for ln in lines if ln.startswith("| 0 | 0.500 | 960 | 160 |"))
    assert "2/3 reached, 1 in time (s0 70*, s1 210)" in row, row
    assert learn68.time_goal([fast]) == [], "no TRL run: no table"


def test_the_accuracy_goal_says_which_side_of_trls_spread_an_arm_lies():
    def tagged(arm: str, seed: int, framework: str = "tidal") -> dict:
        return {**run([0.1]), "arm": arm, "seed": seed, "framework": framework, "adapter": f"{arm}{seed}"}

    accs = {"trl": [0.60, 0.62, 0.64], "hi": [0.80, 0.82, 0.84], "mid": [0.55, 0.70, 0.62], "lo": [0.40, 0.41, 0.61]}
    runs = [tagged(a, s, "TRL" if a == "trl" else "tidal") for a, xs in accs.items() for s in range(len(xs))]
    evals = {f"{a}{s}": {"accuracy": x} for a, xs in accs.items() for s, x in enumerate(xs)}
    rows = {ln.split(" | ")[0]: ln for ln in learn68.accuracy_goal(runs, evals) if ln.startswith("| ")}

    def welch(arm: str) -> str:  # Welch's t in float64 numpy (sample variances, ddof 1)
        x, y = np.array(accs[arm], dtype=np.float64), np.array(accs["trl"], dtype=np.float64)
        return f"{(x.mean() - y.mean()) / np.sqrt(x.var(ddof=1) / x.size + y.var(ddof=1) / y.size):.1f}"

    assert rows["| hi"].endswith(f"| +0.200 | above | above | {welch('hi')} |"), rows["| hi"]
    assert rows["| mid"].endswith(f"| no | no | {welch('mid')} |"), rows["| mid"]
    assert rows["| lo"].endswith(f"| below | no | {welch('lo')} |"), rows["| lo"]  # std below, range overlaps TRL's
    assert welch("hi") == "12.2" and welch("lo") == "-2.1"  # by hand: 0.2 / sqrt(2 x 0.0004 / 3); -0.147 / 0.0693


def test_record_keeps_the_accuracy_on_the_first_256_of_a_larger_set_and_refuses_a_short_one():
    rng = np.random.default_rng()
    rewards = rng.integers(0, 2, size=1024).astype(np.float64)
    got = {"seconds": 1.0, "a0": {"accuracy": rewards.mean(), "lo": 0.1, "hi": 0.9, "rewards": rewards.tolist()}}
    evals: dict = {}
    learn68.record(evals, got, 1024)
    assert evals["a0"]["accuracy"] == rewards.mean() and "seconds" not in evals
    assert abs(evals["a0"]["first256"] - rewards[:256].mean()) < 1e-12
    learn68.record(small := {}, {"b": {**got["a0"], "rewards": rewards[:256].tolist()}}, 256)
    assert "first256" not in small["b"], "the default set: nothing to split off"
    try:
        learn68.record({}, got, 2048)
    except RuntimeError as e:
        assert "1024 problems" in str(e) and "not 2048" in str(e)
    else:
        raise AssertionError("a label scored on fewer problems than asked must not be recorded")


def test_an_independent_set_records_no_first256_and_its_json_refuses_another_seed(tmp_path):
    """`--eval-seed`: problems drawn with another seed are not the default set, so no `first256` is split off; and a
    --json that holds one seed's evaluations refuses to take another seed's (or the default set's)."""
    import subprocess

    rng = np.random.default_rng()
    rewards = rng.integers(0, 2, size=512).astype(np.float64)
    got = {"a0": {"accuracy": rewards.mean(), "lo": 0.1, "hi": 0.9, "rewards": rewards.tolist()}}
    learn68.record(evals := {}, got, 512, first256=False)
    assert evals["a0"]["accuracy"] == rewards.mean() and "first256" not in evals["a0"]
    saved = tmp_path / "s.json"
    saved.write_text('{"runs": [], "evals": {}, "eval_size": 512, "eval_seed": 1235}')
    for extra in ([], ["--eval-seed", "7"]):
        done = subprocess.run([sys.executable, str(BENCH / "learn_68.py"), "--json", str(saved), "--out",
                               str(tmp_path / "r.md"), "--eval-size", "512", *extra], capture_output=True, text=True)
        assert done.returncode != 0 and "drawn with seed 1235" in done.stderr, done.stderr
        assert not (tmp_path / "r.md").exists()
