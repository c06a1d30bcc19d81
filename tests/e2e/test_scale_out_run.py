"""`tidal grpo --train.gpus 2` on the bundled model (real vLLM, two gloo CPU trainer ranks under FSDP2): the run
completes, every step's metrics say two ranks trained, vLLM served the policy the ranks trained (its logprobs
match PEFT with the published adapter), and nothing is left running."""

from __future__ import annotations

import time

import psutil
import pytest

from tests.conftest import free_port, kill_group, tidal
from tests.e2e.test_grpo_runs import alive, assert_adapter_changed, assert_served_trained_policy, check_metrics, small

pytestmark = pytest.mark.vllm


@pytest.mark.slow  # a whole run: make test-all (the default suite keeps the bundled run, ctrl-c, API)
def test_colocate_run_with_two_trainer_ranks(tmp_path):
    run_dir, port = tmp_path / "run", free_port()
    proc = tidal("grpo", "--output-dir", str(run_dir), "--infer.port", str(port), *small(3), "--train.gpus", "2",
                 "--train.zero_level", "2")
    seen: dict[int, tuple[psutil.Process, str]] = {}  # every process the run started, with its command line
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                children = psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                children = []
            for p in children:  # read again each time: a child seen between fork and exec has its parent's argv
                try:
                    cmd = " ".join(p.cmdline())
                except psutil.Error:
                    continue
                seen[p.pid] = (seen[p.pid][0] if p.pid in seen else p, cmd)
            time.sleep(0.5)
        out, _ = proc.communicate(timeout=60)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "starting 2 trainer ranks" in out
    rows = check_metrics(run_dir, 3)
    assert all(r["trainer_ranks"] == 2 and r["optim/steps"] >= 1 and r["memory/peak_gb"] > 0 for r in rows)
    assert_adapter_changed(run_dir, 3)
    assert_served_trained_policy(run_dir, 3)
    assert sum("grpo-train" in cmd for _, cmd in seen.values()) >= 3, "the agent and its 2 ranks"
    time.sleep(1)
    left = alive([p for p, _ in seen.values()])
    assert not left, [cmd for p, cmd in seen.values() if p in left]
