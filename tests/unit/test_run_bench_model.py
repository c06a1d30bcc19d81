"""bench/run_bench.py's `--model` (the long-tail rows on bench/gpu_e2e.py's random-init shapes, GPU ledger row
`partial-rollouts-longtail`): its choices are gpu_e2e's shapes, it is refused outside `--longtail-quick` (exit 2), and
the long-tail tables it writes (bench/longtail.py's `quick_report`, `measure_rows`, `prepend`) hold the rows of
`rows` / `partial_rows` for each run, in order. The run itself: a CPU smoke with `--model tiny` (docs/gpu.md).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "bench"))

import gpu_e2e  # noqa: E402
import longtail  # noqa: E402


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, "bench/run_bench.py", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)


def test_model_takes_gpu_e2e_shapes_and_only_with_longtail_quick():
    proc = bench("--help")
    assert proc.returncode == 0 and "{" + ",".join(gpu_e2e.MODELS) + "}" in proc.stdout
    proc = bench("--model", "0.6b", "--skip-baselines")
    assert proc.returncode == 2 and "--model is for --longtail-quick only" in proc.stderr
    proc = bench("--longtail-quick", "--model", "0.7b")
    assert proc.returncode == 2 and "invalid choice: '0.7b'" in proc.stderr


def fake_run(rng: random.Random) -> dict:
    keys = ["step_s", "total_s", "busy", "running", "waiting", "idle", "rollout_s", "train_s", "staleness",
            "staleness_max", "dropped", "switched", "len_mean", "len_max", "clipped", "reward_last3", "stopped",
            "resumed", "token_stale", "decile_stale", "decile_token_stale"]
    run = {k: rng.uniform(0.1, 9.0) for k in keys}
    run["per_sample"] = [(i * 8.0, rng.random()) for i in range(rng.randint(2, 9))]
    return run


def test_longtail_tables_hold_each_runs_rows(tmp_path):
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    runs = {(w, m): fake_run(rng) for w in ("longtail", "uniform") for m in ("gated", "in_flight")}
    runs["longtail", "partial"] = fake_run(rng)
    lines = longtail.quick_report(runs, ("longtail", "uniform"), ["- header"])
    expect = [*longtail.rows("long tail", runs["longtail", "gated"], runs["longtail", "in_flight"]),
              *longtail.rows("uniform", runs["uniform", "gated"], runs["uniform", "in_flight"]),
              *longtail.partial_rows("long tail", runs["longtail", "in_flight"], runs["longtail", "partial"])]
    assert lines == ["- header", "", "| measure | in-flight | gated | ratio | target |", "|---|---|---|---|---|",
                     *expect]
    lt = {"gated": runs["longtail", "gated"], "in_flight": runs["longtail", "in_flight"]}
    n = len(longtail.rows("long tail", lt["gated"], lt["in_flight"]))
    assert longtail.measure_rows(lt) == expect[:n]
    assert longtail.measure_rows({**lt, "partial": runs["longtail", "partial"]}) == [*expect[:n], *expect[2 * n:]]
    out = tmp_path / "ROLLOUT-LONGTAIL.md"
    longtail.prepend(out, ["first"])
    longtail.prepend(out, ["second"])
    assert out.read_text() == ("# Long-tail rollouts: gated vs in-flight\n\n"
                                "<!-- results -->\nsecond\n\nfirst\n\n")
