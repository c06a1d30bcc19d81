"""QeRL noise in a real co-locate run (bundled model, real vLLM, merged reloads): policies of the first half of
the run are served clean (mismatch ~0 on-policy), those of the second half with noisy RMSNorm weights, so the
rollouts they sample disagree with the clean trainer; the mismatch guard does not judge those steps. Through
merged reloads and the weight push (`nccl`, gloo on CPU); slow."""

from __future__ import annotations

import pytest

from tests.conftest import free_port, kill_group, tidal
from tests.e2e.test_grpo_runs import ORCH_SMALL
from tidal.monitor.metrics import read_metrics

pytestmark = pytest.mark.vllm


@pytest.mark.slow  # default suite budget: the noise itself is unit-tested (tests/unit/test_qerl.py)
@pytest.mark.parametrize("path", ["merged", "push"])
def test_noisy_norms_reach_vllm_and_the_trainer_stays_clean(tmp_path, path):
    run_dir = tmp_path / "run"
    push = ["--orch.weight_broadcast.type", "nccl", "--orch.weight_broadcast.port", str(free_port()),
            "--orch.weight_broadcast.timeout", "120"] if path == "push" else []  # gloo on CPU
    proc = tidal("grpo", "--output-dir", str(run_dir), "--infer.port", str(free_port()), "--orch.max_steps", "6",
                 *ORCH_SMALL, *push, "--orch.max_async_level", "0", "--train.noise_scheduler.enabled", "true",
                 "--train.noise_scheduler.num_stages", "2", "--train.noise_scheduler.sigma_start", "0.2")
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["qerl/sigma"] for r in rows] == [0.0, 0.0, 0.0, 0.2, 0.2, 0.2]
    for r in rows:
        noisy_sampler = r["policy_step"] >= 4  # policies 4+ were published noisy (steps 4-6 of 6, 2 stages)
        assert (r["mismatch_kl"] > 1e-2) == noisy_sampler, (r["step"], r["policy_step"], r["mismatch_kl"])
    assert any(r["policy_step"] >= 4 for r in rows), "a noisy policy sampled"
    assert "mismatch above threshold" not in out, "steps sampled with noise are not judged"
