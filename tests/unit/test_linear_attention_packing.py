"""Packing a model with linear-attention layers (Qwen3.5's gated-delta-net): no recurrent state or convolution
window crosses from one sample into the next.

On a random-init tiny Qwen3.5 (tests/archs.py) in float64: the trainer's packing of a batch (`tidal.trainer.grpo.
_packed`, which reads `tidal.models.families.packing_rule`) gives every sample's logprobs equal to that sample run
alone; the same batch packed several samples to a row (what the trainer does for other models) does not, which is
the leak this rule prevents (the test would fail if the rule were dropped). A Qwen3 model packs as before.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.archs import config_for
from tidal.config.train import TrainConfig
from tidal.models.families import ONE_PER_ROW, PACKED, packing_rule
from tidal.trainer.distributed import Ranks
from tidal.trainer.grpo import _packed
from tidal.trainer.model.attention import prompt_sharing_blocker
from tidal.trainer.step.logprobs import forward_logprobs
from tidal.trainer.step.packing import pack
from tidal.transport.batch import TrainingBatch


def model_of(name: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config_for(name), dtype=torch.float64).eval()


def batch_of(rng: np.random.Generator, n: int, shared_prompt: int = 0) -> TrainingBatch:
    lengths = rng.integers(8, 30, size=n)
    parts = [np.r_[np.full(shared_prompt, 7), rng.integers(3, 128, size=ln)] for ln in lengths]
    lengths = lengths + shared_prompt
    total = int(lengths.sum())
    mask = np.concatenate([np.r_[np.zeros(4), np.ones(ln - 4)] for ln in lengths])
    return TrainingBatch(step=1, temperature=1.0, tokens=np.concatenate(parts), lengths=lengths, loss_mask=mask,
                         inference_logprobs=-rng.random(total), advantages=rng.normal(size=total),
                         rewards=rng.random(n), policy_steps=np.zeros(n), truncated=np.zeros(n, dtype=bool))


def per_sample(model: torch.nn.Module, batch: TrainingBatch, micro) -> dict[int, torch.Tensor]:
    """Sample index -> its tokens' logprobs, read from the packed micro-batches."""
    out = {}
    for mb in micro:
        with torch.no_grad():
            lp = forward_logprobs(model, mb.input_ids, mb.position_ids, 1.0, chunk_size=0)
        for r in range(mb.input_ids.shape[0]):
            for sid in set(mb.seq_ids[r].tolist()) - {-1}:
                out[sid] = lp[r][mb.seq_ids[r] == sid][1:]  # the first token's logprob comes from the row before
    return out


def alone(model: torch.nn.Module, batch: TrainingBatch) -> dict[int, torch.Tensor]:
    out = {}
    for i, s in enumerate(batch.samples()):
        ids = torch.from_numpy(batch.tokens[s].astype(np.int64))[None]
        with torch.no_grad():
            out[i] = forward_logprobs(model, ids, torch.arange(ids.shape[1])[None], 1.0, chunk_size=0)[0, 1:]
    return out


def test_packed_logprobs_equal_one_sample_per_row():
    rng = np.random.default_rng()
    model = model_of("qwen3.5")
    assert packing_rule(model.config) == ONE_PER_ROW
    batch = batch_of(rng, 9)
    cfg = TrainConfig(model="m", sequence_len=128, per_device_train_batch_size=4)
    micro, _ = _packed(model, batch, cfg, 0, _ranks(), skippable=False)
    assert all(len(set(row.tolist()) - {-1}) == 1 for mb in micro for row in mb.seq_ids), "one sample per row"
    want, got = alone(model, batch), per_sample(model, batch, micro)
    assert sorted(got) == list(range(9))
    for i in range(9):
        assert torch.allclose(got[i], want[i], atol=1e-10, rtol=0), f"sample {i}: packed != alone"

    # the same samples packed several to a row: the gated-delta-net's state and conv window cross samples
    naive = pack(batch, 128, 4)
    assert any(len(set(row.tolist()) - {-1}) > 1 for mb in naive for row in mb.seq_ids)
    leaked = per_sample(model, batch, naive)
    gap = max(float((leaked[i] - want[i]).abs().max()) for i in range(9))
    assert gap > 1e-4, f"naive packing should leak the recurrent state across samples (gap {gap})"


def test_a_model_without_linear_attention_still_packs_rows():
    model = model_of("qwen3")
    assert packing_rule(model.config) == PACKED
    batch = batch_of(np.random.default_rng(), 9)
    cfg = TrainConfig(model="m", sequence_len=128, per_device_train_batch_size=4)
    micro, _ = _packed(model, batch, cfg, 0, _ranks(), skippable=False)
    assert any(len(set(row.tolist()) - {-1}) > 1 for mb in micro for row in mb.seq_ids)


def test_linear_attention_models_never_share_prompts():
    qwen35 = config_for("qwen3.5")
    assert "linear-attention" in (prompt_sharing_blocker(qwen35, 4096) or "")
    assert prompt_sharing_blocker(config_for("qwen3"), 4096) is None
    with pytest.raises(ValueError, match="one_per_row"):
        pack(batch_of(np.random.default_rng(), 4, shared_prompt=6), 256, 2, share_prompts=True, one_per_row=True)


def _ranks() -> Ranks:
    return Ranks()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_sample_per_row_on_cuda_with_fla_kernels():
    """GPU ledger row `qwen3.5-fla` (never run here): with flash-linear-attention installed transformers runs its
    chunked kernel; the trainer's packing still gives every sample its logprobs alone (fp32, 1e-4)."""
    pytest.importorskip("fla")
    model = model_of("qwen3.5").float().cuda()
    batch = batch_of(np.random.default_rng(), 9)
    micro, _ = _packed(model, batch, TrainConfig(model="m", sequence_len=128, per_device_train_batch_size=4), 0,
                       _ranks(), skippable=False)
    micro = [mb.to(torch.device("cuda")) for mb in micro]
    got, want = per_sample(model, batch, micro), alone_on(model, batch, torch.device("cuda"))
    assert max(float((got[i] - want[i]).abs().max()) for i in range(9)) < 1e-4


def alone_on(model: torch.nn.Module, batch: TrainingBatch, device: torch.device) -> dict[int, torch.Tensor]:
    out = {}
    for i, s in enumerate(batch.samples()):
        ids = torch.from_numpy(batch.tokens[s].astype(np.int64))[None].to(device)
        with torch.no_grad():
            out[i] = forward_logprobs(model, ids, torch.arange(ids.shape[1], device=device)[None], 1.0,
                                      chunk_size=0)[0, 1:]
    return out


def test_the_tinker_service_gives_each_datum_its_own_row_at_budget_0():
    """`tidal.tinker.trainer.forward_backward` packs data rows with budget 0 for a linear-attention model."""
    from types import SimpleNamespace

    from tidal.tinker.trainer import _micro_batches

    data: list = [SimpleNamespace(tokens=[1] * n) for n in (3, 4, 5)]
    assert _micro_batches(data, 0) == [[0], [1], [2]]
    assert _micro_batches(data, 64) == [[0, 1, 2]]
