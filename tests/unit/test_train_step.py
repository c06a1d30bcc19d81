"""`train_step` on the bundled model: the wiring around the pure loss (old logprobs, iterations, reference
pass, truncation masking) checked on hand-checkable cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.assets import resolve_model
from tidal.config.train import TrainConfig
from tidal.trainer.grpo import train_step
from tidal.trainer.logprobs import forward_logprobs
from tidal.trainer.model import load_policy
from tidal.trainer.optim import make_optimizer
from tidal.transport.batch import TrainingBatch


def own_batch(model: torch.nn.Module, rng: np.random.Generator, truncated: list[bool]) -> TrainingBatch:
    """Random samples whose inference logprobs are the model's own (a perfectly matched sampler)."""
    n = len(truncated)
    lengths = rng.integers(8, 20, n)
    tokens = rng.integers(3, 120, int(lengths.sum()))
    mask = np.concatenate([np.r_[np.zeros(4), np.ones(ln - 4)] for ln in lengths])
    lps = []
    for start, ln in zip(np.cumsum(lengths) - lengths, lengths, strict=True):
        ids = torch.from_numpy(tokens[start:start + ln]).long()[None]
        with torch.no_grad():
            lps.append(forward_logprobs(model, ids, torch.arange(ln)[None], 1.0)[0].numpy())
    adv = np.repeat(rng.normal(size=n), lengths)
    return TrainingBatch(step=1, temperature=1.0, tokens=tokens, lengths=lengths, loss_mask=mask,
                         inference_logprobs=np.concatenate(lps) * mask, advantages=adv * mask, rewards=np.zeros(n),
                         policy_steps=np.zeros(n), truncated=np.array(truncated), max_tokens=16)


@pytest.mark.parametrize("iterations", [1, 2])
def test_train_step_wiring(iterations):
    cfg = TrainConfig(model=resolve_model("tidal:tiny-reverse"), learning_rate=1e-2, per_device_train_batch_size=1,
                      sequence_len=40, loss={"loss_type": "dapo", "beta": 0.1, "num_iterations": iterations,
                                             "mask_truncated_completions": True})
    model, device = load_policy(cfg)
    opt = make_optimizer(model, cfg)
    batch = own_batch(model, np.random.default_rng(0), [True, False, False, True, False])
    m = train_step(model, opt, batch, cfg, device, pad_id=0)

    comp = [int(batch.loss_mask[s].sum()) for s in batch.samples()]
    assert m["masked/truncated"] == pytest.approx((comp[0] + comp[3]) / sum(comp))
    assert m["tokens"] == sum(comp) - comp[0] - comp[3]
    assert m["micro_batches"] > 1, "the case must span several micro-batches"
    assert m["mismatch_kl"] < 1e-9 and m["token_mult_prob_error"] == pytest.approx(1, abs=1e-5)
    assert m["sampling_importance_ratio"] == pytest.approx(1, abs=1e-5)
    steps = {int(s["step"]) for s in opt.state.values()}
    assert steps == {iterations}, "one optimizer step per iteration"
    if iterations == 1:  # the fresh adapter is the base model: policy == reference, no clipping
        assert m["kl"] == 0.0 and m["clip_ratio/region_mean"] == 0.0
    else:  # the second iteration moved away from both the reference and the old policy
        assert m["kl"] > 0 and m["clip_ratio/region_mean"] > 0
