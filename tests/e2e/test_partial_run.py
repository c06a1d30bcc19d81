"""A whole `tidal grpo` run with partial rollouts (orch `partial_rollouts: abort_resume`, issue 52), killed with
SIGKILL and resumed: co-location on CPU reloads merged weights, so at a switch the running completions are stopped
before the reload and continued on the new weights. The resumed run (nothing in flight is checkpointed: it draws
fresh examples; batches the killed orchestrator had written are trained as they are) trains to the last step, and
every batch carries each token's version (`token_versions`) within its sample's (start, end) versions."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from tests.conftest import free_port, kill_group, tidal
from tests.e2e.test_resume_runs import wait_steps
from tidal.monitor.metrics import read_metrics
from tidal.transport.batch import TrainingBatch

pytestmark = pytest.mark.vllm


@pytest.mark.slow  # two co-located starts and 6 steps of long completions (~4 min on 2 cores)
def test_partial_rollouts_run_survives_kill_9_and_resumes(tmp_path):
    run_dir, steps = tmp_path / "run", 6
    args = ["grpo", "--output-dir", str(run_dir), "--infer.port", str(free_port()), "--orch.max_steps", str(steps),
            "--orch.batch_size", "16", "--orch.rollouts_per_example", "4", "--orch.sampling.max_tokens", "300",
            "--orch.sampling.min_tokens", "260", "--orch.async_mode", "in_flight", "--orch.in_flight_groups", "8",
            "--orch.partial_rollouts", "abort_resume", "--orch.max_async_level", "2",
            "--orch.max_off_policy_steps", "3", "--orch.ckpt.interval", "1", "--train.ckpt.interval", "1"]
    proc = tidal(*args)
    try:
        wait_steps(run_dir, 2, [proc], timeout=600)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        kill_group(proc)
    proc = tidal(*args, "--resume")
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "reload: factors" in (run_dir / "configs" / "orch.yaml").read_text()  # merged in place in vLLM's worker
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1)) and any(r["resumed_from"] > 0 for r in rows)
    spanning = 0
    for r in rows:
        b = TrainingBatch.load(run_dir / "rollouts" / f"step_{r['step']}.safetensors")
        assert b.token_versions is not None and b.policy_steps_end is not None and np.isfinite(r["loss"])
        for i, sl in enumerate(b.samples()):
            v = b.token_versions[sl]
            assert v.min() == b.policy_steps[i]  # the prompt's tokens carry the start version; none predates it
            assert v.max() == b.policy_steps_end[i], (r["step"], i)
            spanning += int(v.max() > v.min())
        assert "staleness/token_mean" in r and "staleness/longest_decile" in r
    # whether a switch meets running completions here depends on timing (the stream may have finished the groups
    # it may run when a policy lands): the switch itself is checked in tests/integration/test_partial_rollouts.py
    print(f"samples across a switch: {spanning}; requests stopped: "
          f"{sum(r.get('partial/stopped_requests', 0.0) for r in rows):.0f}")
