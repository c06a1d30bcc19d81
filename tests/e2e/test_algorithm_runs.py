"""Real short runs (bundled model, real vLLM, `grpo-orch` + `grpo-train`) with the algorithm options.

The default suite runs one combined configuration (a clipped loss with KL to the reference, two iterations,
truncated IS correction, entropy masking, teacher distillation from the server's base model, process
supervision, truncated-completion masking, an extra TRL-style reward function), and a run the mismatch guard
stops. Every `loss_type` and `ratio_type` runs in the slow suite.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.conftest import MODEL, kill_group, tidal
from tidal.monitor.metrics import read_metrics
from tidal.transport.batch import TrainingBatch

pytestmark = pytest.mark.vllm

HEALTH = ["masked", "masked/token_low", "masked/token_high", "masked/geo_low", "masked/geo_high",
          "masked/sequence_low", "masked/sequence_high", "masked/entropy", "masked/is", "masked/truncated",
          "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy", "mismatch_kl",
          "token_mult_prob_error", "sampling_importance_ratio", "approx_entropy", "frac_reward_zero_std",
          "reward/reverse-text/mean", "reward/reverse-text/std", "completions/mean_length",
          "completions/min_length", "completions/max_length", "completions/clipped_ratio",
          "completions/mean_terminated_length"]


def run_variant(url: str, run_dir: Path, name: str, train: list[str], orch: list[str], steps: int = 3) -> list[dict]:
    """Run trainer + orchestrator against the shared server for `steps` steps; returns metrics rows."""
    tr = tidal("grpo-train", "--output-dir", str(run_dir), "--train.max_async_level", "8", *train)
    orc = tidal("grpo-orch", "--output-dir", str(run_dir), "--orch.client.base_url", f"[{url}]",
                "--orch.max_steps", str(steps), "--orch.batch_size", "16", "--orch.rollouts_per_example", "4",
                "--orch.sampling.max_tokens", "24", "--orch.sampling.seed", "11",
                "--orch.model.lora_adapter", name, *orch)
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
    for r in rows:
        missing = [k for k in HEALTH if k not in r]
        assert not missing, f"step {r['step']} lacks {missing}"
        assert math.isfinite(r["loss"]) and r["grad_norm"] >= 0 and r["tokens"] > 0
        assert 0 <= r["masked"] <= 1 and 0 <= r["clip_ratio/region_mean"] <= 1
    first = rows[0]
    assert first["mismatch_kl"] < 1e-3 and abs(first["token_mult_prob_error"] - 1) < 1e-2
    assert abs(first["sampling_importance_ratio"] - 1) < 1e-2
    assert first["entropy"] > 0 and first["approx_entropy"] > 0
    return rows


@pytest.mark.slow  # a whole run: make test-all (the default suite keeps the bundled run, ctrl-c, API)
def test_combined_algorithm_options_run(vllm_server, tmp_path):
    run_dir = tmp_path / "run"
    rows = run_variant(vllm_server, run_dir, "combined",
                       ["--train.loss.loss_type", "dapo", "--train.loss.beta", "0.05",
                        "--train.loss.num_iterations", "2", "--train.loss.is_correction", "truncated",
                        "--train.loss.top_entropy_quantile", "0.5", "--train.loss.teacher_tau", "0.1",
                        "--train.loss.mask_truncated_completions", "true", "--train.loss.epsilon_high", "0.28"],
                       ["--orch.advantage.type", "process", "--orch.teacher",
                        json.dumps({"base_url": vllm_server, "model": MODEL}), "--orch.reward_funcs",
                        json.dumps([{"import_path": "tests.e2e.rewards:short_answer", "weight": 0.5,
                                     "kwargs": {"limit": 16}}])])
    for r in rows:
        assert 0 <= r["reward/short_answer/mean"] <= 1 and r["reward/short_answer/std"] >= 0
        assert r["kl"] >= 0 and 0.4 <= r["masked/entropy"] <= 0.6, r
    assert rows[-1]["kl"] > rows[0]["kl"] > 0, "the policy moves away from the reference (the base model)"
    assert any(r["clip_ratio/region_mean"] > 0 for r in rows), "iteration 2 moves ratios off 1"

    # the batch carries the teacher's (base model's) untempered logprobs and process advantages
    from tidal.models.sources import resolve_model
    from tidal.trainer.model.load import load_base_model
    from tidal.trainer.step.logprobs import forward_logprobs

    batch = TrainingBatch.load(run_dir / "rollouts" / "step_2.safetensors")
    assert batch.teacher_logprobs is not None and batch.max_tokens == 24
    base = load_base_model(resolve_model(MODEL), torch.device("cpu"), torch.float32).eval()
    varying = 0
    for i, s in enumerate(batch.samples()[:6]):
        ids = torch.from_numpy(batch.tokens[s]).long()[None]
        with torch.no_grad():
            want = forward_logprobs(base, ids, torch.arange(ids.shape[1])[None], 1.0)[0]
        got = torch.from_numpy(batch.teacher_logprobs[s])
        assert float((got[1:] - want[1:]).abs().max()) < 1e-3, i
        m = batch.loss_mask[s].astype(bool)
        varying += len(set(batch.advantages[s][m].round(6).tolist())) > 1
    assert varying > 0, "process supervision gives per-token advantages"


SLOW_VARIANTS = {
    "aipo-token": ["--train.loss.loss_type", "aipo"],
    "aipo-sequence": ["--train.loss.ratio_type", "sequence"],
    "grpo": ["--train.loss.loss_type", "grpo", "--train.loss.num_iterations", "2"],
    "grpo-gspo": ["--train.loss.loss_type", "grpo", "--train.loss.importance_sampling_level", "sequence",
                  "--train.loss.num_iterations", "2", "--train.loss.epsilon", "0.01"],
    "bnpo": ["--train.loss.loss_type", "bnpo", "--train.loss.ratio_clip_c", "3", "--train.loss.delta", "2"],
    "dr_grpo": ["--train.loss.loss_type", "dr_grpo", "--train.loss.is_correction", "masked"],
    "dapo": ["--train.loss.loss_type", "dapo", "--train.loss.epsilon_high", "0.28",
             "--train.loss.beta", "0.1", "--train.loss.use_on_policy_kl_approximation", "true"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_VARIANTS))
def test_every_loss_type_and_ratio_type_runs(vllm_server, tmp_path, name):
    orch = ["--orch.advantage.scale_rewards", "group"] if name in ("grpo", "bnpo") else []
    rows = run_variant(vllm_server, tmp_path / "run", name.replace("_", "-"), SLOW_VARIANTS[name], orch, steps=4)
    assert all(r["loss"] != 0 for r in rows[1:])


@pytest.mark.slow  # (44 s; the guard's logic is unit-tested in the default suite)
def test_mismatch_guard_stops_a_bf16_server_against_an_fp32_trainer(tmp_path):
    """A real cause of drift: vLLM serving in bfloat16 while the trainer computes in float32."""
    from tests.conftest import free_port

    run_dir = tmp_path / "run"
    proc = tidal("grpo", "--output-dir", str(run_dir), "--infer.port", str(free_port()), "--infer.dtype", "bfloat16",
                 "--orch.max_steps", "3", "--orch.batch_size", "16", "--orch.rollouts_per_example", "4",
                 "--orch.sampling.max_tokens", "24", "--train.mismatch_guard.action", "stop",
                 "--train.mismatch_guard.patience", "1", "--train.mismatch_guard.max_token_mult_prob_error", "1.003")
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_group(proc)
    assert proc.returncode == 1, out[-3000:]
    assert "trainer/inference mismatch above threshold" in out and "dtype" in out and "the trainer exited" in out
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert len(rows) == 1 and rows[0]["token_mult_prob_error"] > 1.003 and rows[0]["off_policy_level"] == 0
