"""bench/learn.py's arithmetic on run curves (the goal lines of bench/LEARN.md), on hand-made curves."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
spec = importlib.util.spec_from_file_location("bench_learn", BENCH / "learn.py")
assert spec is not None and spec.loader is not None
learn = importlib.util.module_from_spec(spec)
spec.loader.exec_module(learn)


def run(framework: str, rewards: list[float], step_s: float, start: float, total: float, seed: int = 0,
        mode: str | None = None, adapter: str = "") -> dict:
    return {"framework": framework, "mode": mode or framework.lower(), "seed": seed, "total_s": total,
            "step_s": step_s, "adapter": adapter or f"{framework}{seed}",
            "curve": [(start + i * step_s, (i + 1) * 64, r) for i, r in enumerate(rewards)]}


def test_time_to_reach_uses_a_running_mean():
    r = run("tidal", [0.0, 0.6, 0.0, 0.6, 0.6, 0.6], 10.0, 50.0, 120.0)
    # running means of 3: 0.0, 0.3, 0.2, 0.4, 0.4, 0.6 -> 0.5 first reached at step 6 (t = 50 + 5 x 10)
    assert learn.time_to_reach(r, 0.5) == 100.0
    assert learn.time_to_reach(r, 0.7) is None
    assert abs(learn.final_reward(r, last=2) - 0.6) < 1e-12


def test_goal_lines_compare_with_trls_final_reward_and_accuracy():
    trl = run("TRL", [0.1, 0.2, 0.3, 0.3, 0.3], 100.0, 60.0, 600.0)
    tidal = run("tidal", [0.1, 0.3, 0.3, 0.4, 0.4], 10.0, 40.0, 100.0)
    evals = {"TRL0": {"accuracy": 0.5}, "tidal0": {"accuracy": 0.6}}
    lines = learn.goal_lines([tidal, trl], evals)
    assert "0.240 after 600 s" in lines[0] and "greedy accuracy 0.500" in lines[0]
    # TRL's target 0.24; tidal's running means 0.1, 0.2, 0.233, 0.333 -> step 4 at t = 40 + 3 x 10 = 70 s
    assert "seed 0 70 s (0.12)" in lines[1] and "0.600 vs TRL's 0.500 (>=)" in lines[1]
    flat = run("TRL", [0.0, 0.0], 100.0, 60.0, 300.0)
    assert "no time comparison" in learn.goal_lines([tidal, flat], evals)[-1]
    assert "no comparison" in learn.goal_lines([tidal], evals)[0]


def test_ratios_pair_each_tidal_run_with_trls_run_of_the_same_seed():
    runs = [run("TRL", [0.1], 50.0, 60.0, 800.0, seed=0), run("TRL", [0.1], 40.0, 60.0, 600.0, seed=1),
            run("tidal", [0.1], 10.0, 40.0, 200.0, seed=1), run("tidal", [0.1], 5.0, 40.0, 100.0, seed=0,
                                                                 mode="tidal-async1")]
    lines = learn.ratio_lines(runs)
    assert "- tidal seed 1: per step 4.00x, whole run 3.00x" in lines  # seed 1's TRL run, not seed 0's
    assert "- tidal-async1 seed 0: per step 10.00x, whole run 8.00x" in lines
    assert learn.spread([1.0, 3.0]) == "2.0 ± 1.4 (1.0-3.0)"


def test_trl_runs_are_reused_only_from_this_machine_and_day(tmp_path):
    import json
    import time

    workload = {"steps": 1}
    today, here = time.strftime("%Y-%m-%d"), learn.machine_id()
    saved = [{"framework": "TRL", "mode": "trl", "seed": 0, "date": today, "machine": here},
             {"framework": "TRL", "mode": "trl", "seed": 1, "date": "2026-11-28", "machine": here},
             {"framework": "TRL", "mode": "trl", "seed": 2, "date": today, "machine": "elsewhere"},
             {"framework": "tidal", "mode": "tidal", "seed": 0, "algorithm": "trl"}]
    (tmp_path / "runs.json").write_text(json.dumps({"workload": workload, "runs": saved}))
    done = learn.load_runs(tmp_path / "runs.json", workload, "trl")
    assert sorted(done) == [("tidal", 0), ("trl", 0)] and all(r["reused"] for r in done.values())


def test_the_trl_algorithm_turns_every_seed_mask_off():
    from tidal.api.loss_keys import NO_SEED_MASKS

    args = learn.ALGORITHMS["trl"]
    for key in NO_SEED_MASKS:
        assert f"--train.loss.{key}" in args, key


def test_phase_cpu_reads_each_side_while_the_other_works():
    samples = [(1.9, 0.02), (1.8, 0.0), (0.05, 1.95), (0.1, 1.7), (0.2, 0.1)]  # (trainer, vLLM) cores
    ph = learn.phase_cpu(samples)
    assert abs(ph["vllm_while_training"] - 0.01) < 1e-12 and abs(ph["trainer_while_sampling"] - 0.075) < 1e-12
    assert abs(ph["trainer_busy"] - 1.85) < 1e-12 and abs(ph["vllm_busy"] - 1.825) < 1e-12
    assert learn.side_of(["python", "-m", "tidal.cli", "grpo-train", "x"], "python") == "trainer"
    assert learn.side_of(["python", "-m", "vllm.entrypoints.openai.api_server"], "python") == "vllm"
    assert learn.side_of([], "VLLM::EngineCore") == "vllm" and learn.side_of(["tidal", "grpo-orch"], "x") is None


def test_a_reused_row_says_where_and_when_it_ran():
    """Issue 66: every reused row was labelled "same machine and day", but tidal's rows are reused from any machine
    and day (only TRL's must match both). The label names the row's own date and machine unless both match."""
    import time

    today, here = time.strftime("%Y-%m-%d"), learn.machine_id()
    fresh = {"framework": "tidal", "mode": "tidal", "date": today, "machine": here}
    assert learn.mode_label(fresh) == "tidal"
    assert learn.mode_label({**fresh, "reused": True}) == "tidal (reused, same machine and day)"
    old = {"framework": "tidal", "mode": "tidal", "date": "2026-11-28", "machine": "box / Xeon / 2 CPUs",
           "reused": True}
    assert learn.mode_label(old) == "tidal (reused: 2026-11-28 on box / Xeon / 2 CPUs)"
    assert learn.mode_label({"framework": "tidal", "reused": True}) == "tidal (reused: ? on ?)"
