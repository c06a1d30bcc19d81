"""Padding-free micro-batches (`tidal.trainer.step.packing`'s `flat`, `tidal.trainer.grpo.flat_rows`): each
micro-batch is one row of the same samples, with no padding, and logprobs and gradients equal the padded rows'
(float64, several architectures, prompts shared or not); models whose attention would cost more on a long row keep
their padded rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.archs import ARCHS, config_for
from tests.unit.test_prompt_sharing import _models, _run, by_token, group_batch
from tidal.trainer.model.attention import ATTN_IMPLEMENTATION, flat_rows_blocker
from tidal.trainer.step.packing import FLAT_MAX_TOKENS, pack, packing_efficiency
from tidal.transport.batch import TrainingBatch

FLAT_ARCHS = ("llama3", "qwen2.5", "qwen3", "mistral", "phi3", "olmo2", "granite")
"""Architectures of the matrix whose per-sample attention runs on any row (no soft-capping, no short window)."""


def _with_padding(rng: np.random.Generator, row: int, size: int, share: bool = True, **kw) -> TrainingBatch:
    """A fresh `group_batch` whose padded micro-batches hold padding (one in ~300-1000 random batches fills its rows
    exactly, and then there is nothing for flat rows to save)."""
    for _ in range(20):
        batch = group_batch(rng, **kw)
        if packing_efficiency(pack(batch, row, size, share_prompts=share)) < 1.0:
            return batch
    raise AssertionError("20 random batches in a row without padding")


def _members(micro: list) -> list[set[int]]:
    return [set(mb.seq_ids[mb.seq_ids >= 0].tolist()) for mb in micro]


@pytest.mark.parametrize("share", [False, True])
def test_flat_micro_batches_hold_the_same_samples_without_padding(share):
    rng = np.random.default_rng()
    batch = _with_padding(rng, 96, 3, share, prompts=5, group=6)
    padded = pack(batch, 96, 3, share_prompts=share)
    flat = pack(batch, 96, 3, share_prompts=share, flat=True)
    assert _members(flat) == _members(padded)  # the same samples in the same micro-batch: the same update
    assert all(mb.input_ids.shape[0] == 1 and mb.input_ids.numel() == mb.num_tokens for mb in flat)
    assert packing_efficiency(flat) == 1.0 > packing_efficiency(padded)
    assert by_token(flat) == by_token(padded)  # every token keeps its data and position
    assert [mb.num_tokens for mb in flat] == [mb.num_tokens for mb in padded]
    assert [mb.attention_mask is not None for mb in flat] == [mb.attention_mask is not None for mb in padded]


def test_a_micro_batch_longer_than_the_cap_keeps_its_rows():
    rng = np.random.default_rng()
    batch = group_batch(rng, prompts=6, group=8, completion=(100, 200), prompt=(50, 60))
    row = 1024
    micro = pack(batch, row, FLAT_MAX_TOKENS // row + 2, flat=True)
    assert micro[0].input_ids.shape[0] > 1 and micro[0].input_ids.shape[1] <= row
    small = pack(batch, row, 2, flat=True)
    assert all(mb.input_ids.shape[0] == 1 for mb in small)


def test_flat_refuses_one_sample_per_row():
    with pytest.raises(ValueError, match="flat"):
        pack(group_batch(np.random.default_rng(), prompts=1, group=2), 96, 2, one_per_row=True, flat=True)


@pytest.mark.parametrize("name", FLAT_ARCHS)
@pytest.mark.parametrize("share", [False, True])
def test_flat_rows_give_the_padded_logprobs_and_gradients(name, share):
    """float64, fresh random batch and weights: tidal's per-sample attention (and SDPA with the same masks) on one
    flat row per micro-batch computes what it computes on padded rows."""
    cfg = config_for(name)
    cfg._attn_implementation = ATTN_IMPLEMENTATION
    assert flat_rows_blocker(cfg, FLAT_MAX_TOKENS) is None
    rng = np.random.default_rng()
    batch = group_batch(rng, prompts=3, group=4)
    padded, flat = pack(batch, 96, 3, share_prompts=share), pack(batch, 96, 3, share_prompts=share, flat=True)
    # every flat token is a sample's; the padded rows hold as many or more (as many when each micro-batch fits one
    # row, which these random lengths sometimes give)
    flat_tokens = sum(mb.input_ids.numel() for mb in flat)
    assert flat_tokens == sum(mb.num_tokens for mb in flat) <= sum(mb.input_ids.numel() for mb in padded)
    weight = {k: float(rng.normal()) for k in by_token(padded)}
    for impl, model in _models(name, torch.float64).items():
        lp_a, g_a = _run(model, padded, weight)
        lp_b, g_b = _run(model, flat, weight)
        assert lp_a.keys() == lp_b.keys() and lp_a
        torch.testing.assert_close(torch.tensor([lp_b[k] for k in lp_a]), torch.tensor(list(lp_a.values())),
                                   rtol=0, atol=1e-10, msg=f"{name} {impl}: logprobs")
        assert g_a.keys() == g_b.keys() and g_a
        for n, g in g_a.items():
            torch.testing.assert_close(g_b[n], g, rtol=1e-6, atol=1e-6 * float(g.abs().max()),
                                       msg=f"{name} {impl}: gradient of {n}")


def test_models_whose_attention_grows_with_the_row_keep_padded_rows():
    def blocker(name: str, impl: str = ATTN_IMPLEMENTATION) -> str | None:
        cfg = config_for(name)
        cfg._attn_implementation = impl
        return flat_rows_blocker(cfg, FLAT_MAX_TOKENS)

    assert all(blocker(n) is None for n in FLAT_ARCHS)
    assert "soft-caps" in (blocker("gemma2") or "")
    assert "sliding-window" in (blocker("gemma3") or "")
    assert "per-sample" in (blocker("llama3", "sdpa") or "")
    assert "per-sample" in (blocker("llama3", "tidal_flex") or "")
    assert blocker("qwen3.5") is not None and blocker("qwen3.5-vlm") is not None
    assert set(FLAT_ARCHS) < set(ARCHS)


def test_train_step_packs_flat_with_the_same_result(tmp_path, monkeypatch):
    """A GRPO step on the same batch with flat and padded micro-batches: the same loss and gradient norm, fewer
    tokens through the model, packing efficiency 1."""
    from tests.archs import build
    from tidal.config.train import TrainConfig
    from tidal.trainer import grpo
    from tidal.trainer.model.load import load_policy
    from tidal.trainer.step.optim import make_optimizer

    path = build("qwen3", tmp_path / "m")
    batch = _with_padding(np.random.default_rng(), 128, 3, prompts=4, group=8)
    out = {}
    for flat in (True, False):
        cfg = TrainConfig(model=str(path), lora=True, lora_rank=4, sequence_len=128, per_device_train_batch_size=3,
                          device="cpu", learning_rate=1e-3)
        torch.manual_seed(0)
        model, device = load_policy(cfg)
        assert grpo.flat_rows(model, batch)
        if not flat:
            monkeypatch.setattr(grpo, "flat_rows", lambda model, batch: False)
        out[flat] = grpo.train_step(model, make_optimizer(model, cfg), batch, cfg, device, pad_id=0)
    assert out[True]["packing_efficiency"] == 1.0 > out[False]["packing_efficiency"]
    assert out[True]["processed_tokens"] == out[False]["processed_tokens"]
    for key in ("loss", "grad_norm", "tokens", "mismatch_kl"):
        assert out[True][key] == pytest.approx(out[False][key], rel=1e-5, abs=1e-7), key
