"""QLoRA in a real co-locate run (bundled model, real vLLM, merged reloads): the trainer quantizes its base
(NF4 / FP8), publishes policy 0 as the dequantized base, and the orchestrator has vLLM reload it before the first
rollout, so even step 1's rollouts are sampled by the policy the trainer scores (mismatch KL <= 1e-3 in fp32;
measured ~1e-12), and so are later ones (on-policy, max_async_level 0). Without policy 0 vLLM would sample the
original weights."""

from __future__ import annotations

import pytest

from tests.conftest import free_port, kill_group, tidal
from tests.e2e.test_grpo_runs import ORCH_SMALL
from tidal.monitor.metrics import read_metrics
from tidal.transport import weights

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("key", [pytest.param("qlora_bnb", marks=pytest.mark.slow),
                                 pytest.param("qlora_fp8", marks=pytest.mark.slow)])
def test_qlora_run_serves_the_quantized_base_from_step_one(tmp_path, key):
    run_dir = tmp_path / "run"
    proc = tidal("grpo", "--output-dir", str(run_dir), "--infer.port", str(free_port()), "--orch.max_steps", "2",
                 *ORCH_SMALL, "--orch.max_async_level", "0", f"--train.{key}", "true")
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "published policy 0" in out and "policy 0 (the trainer's dequantized base) served" in out, out[-4000:]
    assert f"QLoRA base ({'NF4' if key == 'qlora_bnb' else 'FP8'})" in out
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["policy_step"] for r in rows] == [0, 1]  # on-policy: policy 1 = dequantized base + merged LoRA
    for r in rows:
        assert r["mismatch_kl"] <= 1e-3, (r["step"], r["mismatch_kl"])
    assert 0 in weights.stable_steps(run_dir)
