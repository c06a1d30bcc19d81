"""bench/soak.py (`make bench-soak`, issue 44 item 6): process roles, the per-step slope, the table, and the sampler
on a real process tree (no vLLM: the soak itself is a bench, not a test)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


soak = load("soak")


def test_roles_come_from_the_command_line_of_each_process_of_a_run():
    py = "/venv/bin/python"
    assert soak.role_of("VLLM::EngineCore", [py, "-m", "vllm.entrypoints.openai.api_server"]) == "engine-core"
    assert soak.role_of("python", [py, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", "m"]) \
        == "api-server"
    assert soak.role_of("python", [py, "-m", "tidal.cli", "grpo-train", "train.yaml"]) == "trainer"
    assert soak.role_of("python", [py, "-m", "tidal.cli", "grpo-orch", "orch.yaml"]) == "orchestrator"
    assert soak.role_of("python", [py, "-m", "tidal.procs.reaper", "12"]) == "reaper"
    assert soak.role_of("python", [py, "-m", "tidal.cli", "grpo", "--output-dir", "x"]) == "launcher"
    assert soak.role_of("bash", ["bash"]) == "other"


def test_slope_is_the_least_squares_growth_per_step():
    assert soak.slope([(10, 100.0), (20, 120.0), (30, 140.0)]) == pytest.approx(2.0)
    assert soak.slope([(10, 100.0), (20, 100.0), (30, 100.0)]) == pytest.approx(0.0)
    assert soak.slope([(10, 1.0), (20, 3.0), (30, 2.0), (40, 4.0)]) == pytest.approx(0.08)
    assert soak.slope([(10, 1.0)]) != soak.slope([(10, 1.0)])  # nan: one point has no slope
    assert soak.slope([(10, 1.0), (10, 2.0)]) != soak.slope([(10, 1.0), (10, 2.0)])


def test_summary_per_process_from_the_warm_up_step_on_named_as_last_seen():
    mib = soak.MIB

    def sample(step: int, engine: float, api: float) -> dict:
        return {"t": step, "step": step, "procs": {("other 7" if step < 5 else "engine-core 7"): {"rss": engine * mib},
                                                   "api-server 6": {"rss": api * mib, "uss": api * mib / 2}}}

    samples = [sample(s, 100 + (1000 if s < 10 else 2 * s), 50.0) for s in range(0, 31, 5)]
    rows = soak.summarize(samples, from_step=10)
    assert [r["proc"] for r in rows] == ["engine-core 7", "api-server 6"]
    engine, api = rows
    assert (engine["from_step"], engine["to_step"], engine["n"]) == (10, 30, 5)
    assert (engine["rss_first"], engine["rss_last"]) == (120.0, 160.0)
    assert engine["rss_slope"] == pytest.approx(2.0) and "uss_slope" not in engine
    assert api["rss_slope"] == pytest.approx(0.0) and api["uss_last"] == 25.0
    text = soak.table(rows)
    assert "| engine-core 7 | 10–30 | 5 | 120 | 160 | +2.000 | - | - | - | - |" in text
    assert "| api-server 6 | 10–30 | 5 | 50 | 50 | +0.000 | 25 | 25 | +0.000 | - |" in text


def test_sampler_reads_every_process_of_the_tree_and_the_steps_done(tmp_path):
    pytest.importorskip("psutil")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2}\n')
    child = ("import subprocess, sys, time; "
             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)")
    proc = subprocess.Popen([sys.executable, "-c", child])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            procs = soak.sample_tree(proc.pid)
            if len(procs) == 2:
                break
            time.sleep(0.1)
        assert sorted(k.split()[0] for k in procs) == ["launcher", "other"], procs
        assert f"launcher {proc.pid}" in procs
        assert all(m["rss"] > 1024 * 1024 for m in procs.values())
        assert soak.steps_done(metrics) == 2 and soak.steps_done(tmp_path / "none") == 0
    finally:
        for p in reversed(__import__("psutil").Process(proc.pid).children(recursive=True)):
            os.kill(p.pid, 9)
        proc.kill()
        proc.wait()
