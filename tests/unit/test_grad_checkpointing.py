"""Activation checkpointing (train `gradient_checkpointing`): with LoRA and packed rows, the LoRA gradients are
those without it (float32, tight tolerance), for a tied-embedding (Qwen3) and an untied (Llama) architecture, and
the decoder layers really are recomputed in the backward. Random-init models saved from configs; no downloads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tidal.config.train import TrainConfig
from tidal.trainer.model.load import load_policy
from tidal.trainer.step.logprobs import forward_logprobs

V = 97


def save_tiny(arch: str, path: Path) -> str:
    """A 3-layer random model of `arch` saved to `path` (what `train.model` points at)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    torch.manual_seed(0)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=True))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    model.save_pretrained(path)
    return str(path)


def packed_rows(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows of three samples each, position_ids restarting per sample; loss on each sample's second half."""
    lengths = [13, 8, 11]
    ids = torch.randint(0, V, (2, sum(lengths)), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths]).repeat(2, 1)
    mask = torch.cat([torch.arange(n) >= n // 2 for n in lengths]).repeat(2, 1)
    return ids, pos, mask


def lora_grads(model_dir: str, checkpointing: bool, chunk: int) -> tuple[dict[str, torch.Tensor], int]:
    """LoRA gradients of a weighted logprob loss on packed rows, and how often layer 0's attention ran forward
    (the recomputation stops early, after the last tensor it needs: the layer's own hook may not run again)."""
    cfg = TrainConfig(model=model_dir, device="cpu", recipe="fp32", gradient_checkpointing=checkpointing,
                      logprob_chunk_size=chunk, lora_rank=4, lora_alpha=8)
    model, _ = load_policy(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero B factors, so the A factors get gradients too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    layer = model.get_base_model().model.layers[0].self_attn
    calls = []
    handle = layer.register_forward_hook(lambda *_: calls.append(1))
    ids, pos, mask = packed_rows(gen)
    weights = torch.randn(ids.shape, generator=gen)
    lp = forward_logprobs(model, ids, pos, 0.8, chunk_size=chunk, loss_mask=mask)
    (lp * weights * mask).sum().backward()
    handle.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return grads, len(calls)


@pytest.mark.parametrize("chunk", [16, 0])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_checkpointing_keeps_lora_gradients(arch, chunk, tmp_path):
    model_dir = save_tiny(arch, tmp_path / arch)
    plain, plain_calls = lora_grads(model_dir, False, chunk)
    ckpt, ckpt_calls = lora_grads(model_dir, True, chunk)
    assert plain_calls == 1 and ckpt_calls == 2, "with checkpointing the layers run again in the backward"
    assert sorted(plain) == sorted(ckpt) and len(plain) == 3 * 7 * 2, "every LoRA factor of every layer has a grad"
    assert all(float(g.abs().max()) > 0 for g in plain.values())
    for name, g in plain.items():
        torch.testing.assert_close(ckpt[name], g, rtol=1e-6, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}")


def test_checkpointing_flag_reaches_the_layers(tmp_path):
    cfg = TrainConfig(model=save_tiny("llama", tmp_path / "m"), device="cpu", gradient_checkpointing=True)
    model, _ = load_policy(cfg)
    base = model.get_base_model()  # type: ignore[operator]
    assert base.is_gradient_checkpointing and model.training
    assert all(layer.gradient_checkpointing for layer in base.model.layers)
    off, _ = load_policy(cfg.model_copy(update={"gradient_checkpointing": False}))
    assert not off.get_base_model().is_gradient_checkpointing  # type: ignore[operator]


def test_train_step_with_checkpointing_matches(tmp_path):
    """A whole GRPO `train_step` on the bundled model (KL to the reference: the no-grad pass with adapters
    disabled runs through the checkpointed layers too): the same loss, grad norm and metrics."""
    import numpy as np

    from tests.unit.test_train_step import own_batch
    from tidal.models.sources import resolve_model
    from tidal.trainer.grpo import train_step
    from tidal.trainer.step.optim import make_optimizer

    results = []
    for checkpointing in (False, True):
        cfg = TrainConfig(model=resolve_model("tidal:tiny-reverse"), device="cpu", learning_rate=1e-2,
                          per_device_train_batch_size=1, sequence_len=40, gradient_checkpointing=checkpointing,
                          loss={"loss_type": "grpo", "beta": 0.1, "num_iterations": 2})
        model, device = load_policy(cfg)
        batch = own_batch(model, np.random.default_rng(3), [False] * 5)
        results.append(train_step(model, make_optimizer(model, cfg), batch, cfg, device, pad_id=0))
    plain, ckpt = results
    for key in ("loss", "grad_norm", "kl", "entropy", "mismatch_kl", "tokens"):
        assert ckpt[key] == pytest.approx(plain[key], rel=1e-6, abs=1e-12), key
