"""`tidal grpo --infer.backend sglang` end to end on a GPU, with each weight-sync path: LoRA adapters
(`/load_lora_adapter`), merged weights from disk (`/update_weights_from_disk`) and the NCCL push
(`/init_weights_update_group` + `/update_weights_from_distributed`), on the bundled model and on a Qwen3-0.6B-shaped
model (random init, the bundled tokenizer). Step 1's mismatch KL (trainer vs SGLang logprobs of the same tokens,
bfloat16 on both sides) must be <= 1e-3, and so must step 2's, sampled (max_async_level 0) by policy 1 after a
weight sync.

Skipped without CUDA or without the `sglang` package (never on this project's CPU machines: docs/sglang.md). On a
GPU machine: `bash scripts/sglang_gpu_bundle.sh` here, carry the parts, then
`source .sglang-kit/install.sh && python -m pytest tests/e2e/test_sglang_gpu.py -m gpu -x -q` (docs/sglang.md).
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import free_port, kill_group, tidal

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None,
    reason="needs a CUDA GPU with sglang installed (scripts/sglang_gpu_bundle.sh, docs/sglang.md)")]

BUNDLED = Path(__file__).resolve().parents[2] / "src" / "tidal" / "assets" / "tiny-reverse"
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, tie_word_embeddings=True, num_hidden_layers=28)
SYNC = {  # weight-sync path: the extra command-line keys
    "lora": [],
    "merged": ["--orch.weight_broadcast.reload", "merged", "--train.broadcast_merged", "true",
               "--infer.weight_reload", "true"],
    "nccl": ["--orch.weight_broadcast.type", "nccl", "--orch.weight_broadcast.port", "0"],
}


def qwen3_0_6b(out: Path) -> Path:
    """A Qwen3-0.6B-shaped model in bfloat16 (random init) with the bundled model's tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_0_6B, torch_dtype="bfloat16")).to(torch.bfloat16)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(BUNDLED / name, out / name)
    return out


@pytest.mark.parametrize("sync", sorted(SYNC))
@pytest.mark.parametrize("model", ["bundled", "qwen3-0.6b-shaped"])
def test_grpo_with_sglang_syncs_weights_and_starts_on_policy(model, sync, tmp_path):
    from tidal.monitor.metrics import read_metrics

    path = str(BUNDLED) if model == "bundled" else str(qwen3_0_6b(tmp_path / "model"))
    run_dir = tmp_path / "run"
    extra = [x if x != "0" else str(free_port()) for x in SYNC[sync]]
    proc = tidal("grpo", "--model", path, "--output-dir", str(run_dir), "--infer.backend", "sglang",
                 "--infer.port", str(free_port()), "--infer.dtype", "bfloat16", "--orch.max_steps", "2",
                 "--orch.batch_size", "16", "--orch.rollouts_per_example", "4", "--orch.sampling.max_tokens", "32",
                 "--orch.max_async_level", "0", *extra)  # step 2 sampled by policy 1: only after a sync
    try:
        out, _ = proc.communicate(timeout=1500)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-6000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2], out[-3000:]
    assert rows[0]["mismatch_kl"] <= 1e-3, f"{model}/{sync}: step-1 mismatch KL {rows[0]['mismatch_kl']}"
    assert rows[1]["mismatch_kl"] <= 1e-3, f"{model}/{sync}: step 2 was not sampled by policy 1 (sync failed?)"
