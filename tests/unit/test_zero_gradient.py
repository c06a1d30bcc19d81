"""Train `skip_zero_gradient`: `zero_gradient` is true exactly where a micro-batch's loss has zero gradient (every
loss_type x is_correction, float64, fresh random inputs; the KL, entropy, teacher and aipo `kl_tau` terms keep it
false because they have a gradient without the advantage), and a training step that skips those backwards leaves
the same parameters, bit for bit, as one that runs them (LoRA and full fine-tuning, AdamW over two steps, the
second with every advantage 0)."""

from __future__ import annotations

import random
from typing import get_args

import numpy as np
import pytest
import torch

from tests.unit.dist_worker import config, fixed_batch
from tidal.config.loss import LossConfig
from tidal.trainer.grpo import train_step
from tidal.trainer.policy import build_policy
from tidal.trainer.step.loss import LossInputs, LossScale, policy_loss, zero_gradient
from tidal.trainer.step.packing import pack
from tidal.transport.batch import TrainingBatch

LOSS_TYPES = get_args(LossConfig.model_fields["loss_type"].annotation)
IS_MODES = get_args(LossConfig.model_fields["is_correction"].annotation)


def inputs(gen: torch.Generator, advantages: str) -> LossInputs:
    """Three rows of 12 tokens, one sequence each, the last two positions padding; float64."""
    b, t = 3, 12
    lp = (-torch.rand(b, t, generator=gen, dtype=torch.float64) * 3).requires_grad_(True)
    old = lp.detach() + 0.3 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    inf = old + 0.02 * torch.randn(b, t, generator=gen, dtype=torch.float64)  # sequence IS weights within caps
    mask = (torch.rand(b, t, generator=gen) < 0.7).double()
    mask[:, 0] = 1.0
    seq = torch.arange(b)[:, None].expand(b, t).clone()
    seq[:, -2:] = -1
    adv = (torch.randn(b, 1, generator=gen, dtype=torch.float64) * torch.ones(b, t, dtype=torch.float64)
           if advantages == "random" else torch.zeros(b, t, dtype=torch.float64))
    if advantages == "outside_mask":  # nonzero only where no loss is taken
        adv = torch.where(mask.bool(), 0.0, 1.0 + torch.rand(b, t, generator=gen, dtype=torch.float64))
    ref = lp.detach() - 0.2 * torch.rand(b, t, generator=gen, dtype=torch.float64)
    return LossInputs(logprobs=lp, old_logprobs=old, inference_logprobs=inf, advantages=adv, loss_mask=mask,
                      seq_ids=seq, ref_logprobs=ref,
                      teacher_logprobs=lp.detach() - torch.rand(b, t, generator=gen, dtype=torch.float64),
                      entropy=torch.rand(b, t, generator=gen, dtype=torch.float64))


def grad_of(x: LossInputs, cfg: LossConfig) -> torch.Tensor:
    loss, _ = policy_loss(x, cfg, LossScale(step_tokens=float(x.loss_mask.sum()), step_sequences=3, micro_batches=1,
                                            max_completion_len=12))
    (g,) = torch.autograd.grad(loss, x.logprobs, allow_unused=True)
    return torch.zeros_like(x.logprobs) if g is None else g


def configs() -> list[LossConfig]:
    out = []
    for t in LOSS_TYPES:
        for m in IS_MODES if t != "aipo" else ("none",):
            try:
                out.append(LossConfig(loss_type=t, is_correction=m, beta=0.0))
            except ValueError:  # a combination the config refuses (e.g. vespo with a sequence IS mode)
                continue
    return out


@pytest.mark.parametrize("cfg", configs(), ids=lambda c: f"{c.loss_type}-{c.is_correction}")
def test_zero_advantages_give_exactly_zero_gradient_and_the_predicate_says_so(cfg):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    for kind in ("zero", "outside_mask"):
        x = inputs(gen, kind)
        assert zero_gradient(x.advantages, x.loss_mask, cfg), (kind, seed)
        assert torch.equal(grad_of(x, cfg), torch.zeros_like(x.logprobs)), (kind, seed)
    x = inputs(gen, "random")
    assert not zero_gradient(x.advantages, x.loss_mask, cfg)
    assert grad_of(x, cfg).abs().max() > 0, seed


@pytest.mark.parametrize("update", [{"loss_type": "dapo", "beta": 0.1}, {"loss_type": "aipo", "kl_tau": 0.5},
                                    {"loss_type": "grpo", "beta": 0.0, "teacher_tau": 0.5},
                                    {"loss_type": "dapo", "beta": 0.0, "entropy_coef": 0.1}],
                         ids=["beta", "kl_tau", "teacher_tau", "entropy_coef"])
def test_terms_without_the_advantage_keep_the_backward(update):
    """Each term the predicate excludes really has a gradient at zero advantages (so skipping would be wrong)."""
    seed = random.randrange(2**31)
    cfg = LossConfig(**update)
    x = inputs(torch.Generator().manual_seed(seed), "zero")
    assert not zero_gradient(x.advantages, x.loss_mask, cfg)
    grad = grad_of(x, cfg)
    if "entropy_coef" in update:  # the entropy bonus's gradient flows through the entropies, not the logprobs
        assert x.entropy is not None
        x.entropy = x.entropy.clone().requires_grad_(True)
        loss, _ = policy_loss(x, cfg, LossScale(step_tokens=float(x.loss_mask.sum()), step_sequences=3,
                                                micro_batches=1, max_completion_len=12))
        (grad,) = torch.autograd.grad(loss, x.entropy)
    assert grad.abs().max() > 0, seed


def batch_with_zero_groups(seed: int, zero_share: float) -> TrainingBatch:
    """fixed_batch with the advantages of its first `zero_share` of samples set to 0 (1: all of them)."""
    b = fixed_batch(seed)
    b.advantages[:int(b.lengths[:round(zero_share * len(b.lengths))].sum())] = 0.0
    return b


def batch_with_zero_micro_batches(seed: int, cfg) -> tuple[TrainingBatch, int, int]:
    """fixed_batch with the advantages of every other micro-batch (as `cfg` packs it: one optimizer step each, so
    the skip repacks nothing) set to 0: (batch, micro-batches, zeroed micro-batches), whatever lengths were drawn."""
    b = fixed_batch(seed)
    micro = pack(b, cfg.sequence_len, cfg.per_device_train_batch_size)
    starts = np.r_[0, np.cumsum(b.lengths)[:-1]]
    for mb in micro[::2]:
        for i in {int(i) for i in mb.seq_ids.unique() if i >= 0}:
            b.advantages[starts[i]:starts[i] + b.lengths[i]] = 0.0
    return b, len(micro), len(micro[::2])


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_skipping_leaves_the_same_parameters(lora):
    # accumulation 1: every micro-batch its own optimizer step, so the packing is the same with and without the
    # skip (one optimizer step would pack the zero samples apart: the test below) and the update is bit for bit
    cfgs = {skip: config(1, 1, 1, "dapo", lora).model_copy(
        update={"loss": LossConfig(loss_type="dapo", beta=0.0), "skip_zero_gradient": skip, "learning_rate": 1e-3})
        for skip in (True, False)}
    pols = {skip: build_policy(cfgs[skip], 10) for skip in cfgs}
    seed = random.randrange(2**31)
    for step in range(2):  # every other micro-batch zero, then all of them (AdamW still moves)
        if step == 0:
            batch, micro_want, zeroed = batch_with_zero_micro_batches(seed + step, cfgs[True])
            assert 0 < zeroed < micro_want, (zeroed, micro_want, seed)
        else:
            batch = batch_with_zero_groups(seed + step, 1.0)
            zeroed = micro_want = len(pack(batch, cfgs[True].sequence_len, 1))
        before = {n: q.detach().clone() for n, q in pols[False].model.named_parameters()}
        m = {s: train_step(p.model, p.opt, batch, cfgs[s], p.device, p.pad_id, sched=p.sched,
                           reference=p.reference) for s, p in pols.items()}
        # exactly the zeroed micro-batches skip, and only with the skip on (the half case built so that some do
        # and some do not on every draw: weakening it to `skipped < micro` let a never-skipping step pass)
        assert m[True]["micro_batches"] == m[False]["micro_batches"] == micro_want, seed
        assert m[True]["micro_batches/skipped"] == zeroed and m[False]["micro_batches/skipped"] == 0, seed
        assert m[True]["loss"] == m[False]["loss"] and m[True]["grad_norm"] == m[False]["grad_norm"]
        assert m[True]["mismatch_kl"] == m[False]["mismatch_kl"]
        b = dict(pols[False].model.named_parameters())
        for n, q in pols[True].model.named_parameters():
            assert torch.equal(q, b[n]), (n, step, seed)
        assert any(not torch.equal(before[n], q) for n, q in b.items()), "AdamW moves even on zero gradients"


def test_zero_gradient_samples_are_packed_apart_and_every_sample_once():
    seed = random.randrange(2**31)
    batch = fixed_batch(seed % 1000)
    rng = np.random.default_rng(seed)
    apart = [bool(x) for x in rng.random(len(batch.lengths)) < 0.5]
    micro = pack(batch, 40, 2, apart=apart)
    seen: list[int] = []
    for mb in micro:
        ids = sorted({int(i) for i in mb.seq_ids.unique() if i >= 0})
        assert len({apart[i] for i in ids}) == 1, (ids, seed)  # never mixed
        seen += ids
    assert sorted(seen) == list(range(len(batch.lengths)))
    flags = [apart[int(mb.seq_ids[mb.seq_ids >= 0][0])] for mb in micro]
    assert flags == sorted(flags), "the flagged micro-batches come last"


@pytest.mark.parametrize("quantile", [1.0, 0.3])
def test_one_optimizer_step_repacks_zero_samples_apart_with_the_same_update(quantile):
    """Interleaved zero-advantage samples in one optimizer step: packed apart, their micro-batches skip the
    backward, and the update equals the unskipped one's (plain SGD, so float-summation order shows as itself).
    With `top_entropy_quantile` < 1 the entropy mask takes its quantile per micro-batch, so repacking would change
    which tokens train: the samples stay packed as without the skip, and the update is still the unskipped one's."""
    seed = random.randrange(2**31)
    batch = fixed_batch(seed % 1000)
    starts = np.r_[0, np.cumsum(batch.lengths)[:-1]]
    for k, (s, n) in enumerate(zip(starts, batch.lengths, strict=True)):
        if k % 2:
            batch.advantages[s:s + n] = 0.0
    loss = LossConfig(loss_type="dapo", beta=0.0, top_entropy_quantile=quantile)
    cfgs = {skip: config(1, 1, 64, "dapo").model_copy(update={"loss": loss, "skip_zero_gradient": skip,
                                                               "per_device_train_batch_size": 2})
            for skip in (True, False)}
    pols = {skip: build_policy(cfgs[skip], 10) for skip in cfgs}
    m = {}
    for skip, p in pols.items():
        p.opt = torch.optim.SGD([q for q in p.model.parameters() if q.requires_grad], lr=0.5)
        m[skip] = train_step(p.model, p.opt, batch, cfgs[skip], p.device, p.pad_id, sched=p.sched)
    assert m[True]["optim/steps"] == m[False]["optim/steps"] == 1
    assert m[True]["loss"] == pytest.approx(m[False]["loss"], rel=1e-5, abs=1e-7), seed
    b = dict(pols[False].model.named_parameters())
    for n, q in pols[True].model.named_parameters():
        torch.testing.assert_close(q, b[n], rtol=1e-5, atol=1e-6, msg=f"{n} seed {seed}")
    assert m[False]["micro_batches/skipped"] == 0
    if quantile == 1:
        assert m[True]["micro_batches/skipped"] >= 1
    else:  # packed as without the skip; only a micro-batch that happens to hold zero samples alone skips
        assert m[True]["micro_batches"] == m[False]["micro_batches"]
