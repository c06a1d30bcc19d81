"""`tidal sft` pieces: the (label-smoothed) loss against a float64 reference, and batch construction."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tidal.trainer.sft import sft_loss
from tidal.trainer.step.packing import pack
from tidal.transport.batch import TrainingBatch


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128)
    return Qwen3ForCausalLM(cfg).double().eval()


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.5])
def test_sft_loss_matches_float64_reference(model, eps):
    rng = np.random.default_rng()
    lengths = rng.integers(4, 12, size=5)
    total = int(lengths.sum())
    mask = np.concatenate([np.r_[np.zeros(2), np.ones(n - 2)] for n in lengths])
    batch = TrainingBatch(step=1, temperature=1.0, tokens=rng.integers(0, 50, total), lengths=lengths,
                          loss_mask=mask, inference_logprobs=np.zeros(total), advantages=np.zeros(total),
                          rewards=np.zeros(5), policy_steps=np.zeros(5))
    (mb,) = pack(batch, 128, 1)
    with torch.no_grad():
        got = float(sft_loss(model, mb, eps))
        ref = 0.0
        for s in batch.samples():  # each sample alone, explicit loops over positions and the vocabulary
            ids = torch.from_numpy(batch.tokens[s]).long()[None]
            logits = model(input_ids=ids).logits[0].tolist()
            for t in range(1, ids.shape[1]):
                if not batch.loss_mask[s][t]:
                    continue
                row = logits[t - 1]
                lse = math.log(sum(math.exp(x) for x in row))
                nll = lse - row[int(ids[0, t])]
                uniform = sum(lse - x for x in row) / len(row)
                ref += (1 - eps) * nll + eps * uniform
    assert got == pytest.approx(ref, rel=1e-6)  # log-softmax runs in float32 by design
