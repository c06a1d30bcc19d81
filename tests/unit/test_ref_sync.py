"""TR-DPO's reference updates (train `loss.sync_ref_model`, TRL's `sync_ref_model`) with full fine-tuning: after
every k-th optimizer step the reference is alpha x policy + (1 - alpha) x reference (checked against float64 on
the real train step), the KL term then scores against it, the checkpoint keeps it, and LoRA / no KL / several
ranks are refused with the reason."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from tests.unit.dist_worker import config, fixed_batch
from tidal.config.train import TrainCkptSection, TrainConfig
from tidal.trainer.grpo import train_step
from tidal.trainer.policy import Policy, build_policy, restore, save


def sync_config(alpha: float, steps: int) -> TrainConfig:
    base = config(1, 1, 16, "dapo", lora=False)  # one optimizer step per batch
    loss = base.loss.model_copy(update={"sync_ref_model": True, "ref_model_mixup_alpha": alpha,
                                        "ref_model_sync_steps": steps})
    return base.model_copy(update={"learning_rate": 1e-3, "loss": loss, "ckpt": TrainCkptSection(interval=1)})


def step(p: Policy, cfg: TrainConfig, seed: int) -> dict[str, float]:
    return train_step(p.model, p.opt, fixed_batch(seed), cfg, p.device, p.pad_id, sched=p.sched,
                      reference=p.reference)


def weights(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: q.detach().to(torch.float64).clone() for n, q in m.named_parameters()}


def test_reference_mixes_toward_the_policy_every_k_steps(tmp_path):
    cfg = sync_config(0.3, 2)
    p = build_policy(cfg, 10)
    assert p.reference is not None
    r0 = weights(p.reference)
    step(p, cfg, 1)
    assert all(torch.equal(q, r0[n]) for n, q in weights(p.reference).items()), "step 1 of k=2: unchanged"
    m2 = step(p, cfg, 2)
    assert m2["kl"] > 0, "step 2 scored against the initial reference, which the policy has left"
    policy = weights(p.model)
    ref = weights(p.reference)
    moved = 0
    for n, r in ref.items():
        expect = 0.3 * policy[n] + 0.7 * r0[n]  # float64 reference of the rule
        torch.testing.assert_close(r, expect, rtol=2e-6, atol=1e-7)
        moved += int(not torch.equal(r, r0[n]))
    assert moved == len(ref), "every weight of the reference moved"
    save(p, tmp_path, 2, cfg)
    b = build_policy(cfg, 10)
    restore(b, tmp_path, 2)
    assert b.reference is not None
    assert all(torch.equal(q, ref[n].to(q.dtype)) for n, q in b.reference.named_parameters()), "checkpointed"


def test_kl_term_scores_against_the_synced_reference():
    """alpha = 1 copies the policy into the reference after every step: the next step's KL is exactly 0."""
    cfg = sync_config(1.0, 1)
    p = build_policy(cfg, 10)
    step(p, cfg, 1)
    m = step(p, cfg, 2)
    assert m["kl"] == 0.0
    unsynced = cfg.model_copy(update={"loss": cfg.loss.model_copy(update={"ref_model_sync_steps": 5})})
    q = build_policy(unsynced, 10)
    step(q, unsynced, 1)
    assert step(q, unsynced, 2)["kl"] > 0


def test_sync_ref_model_refusals_say_why():
    full = config(1, 1, 16, "dapo", lora=False)
    with pytest.raises(ValidationError, match=r"sync_ref_model needs full fine-tuning .*product"):
        TrainConfig.model_validate(config(1, 1, 16, "dapo").model_dump() | {
            "loss": {"loss_type": "dapo", "beta": 0.05, "sync_ref_model": True}})
    with pytest.raises(ValidationError, match=r"sync_ref_model needs loss.beta > 0"):
        TrainConfig.model_validate(full.model_dump() | {"loss": {"loss_type": "dapo", "sync_ref_model": True}})
    with pytest.raises(ValidationError, match=r"ref_model_sync_steps applies with loss.sync_ref_model"):
        TrainConfig.model_validate(full.model_dump() | {"loss": {"loss_type": "dapo", "beta": 0.1,
                                                                 "ref_model_sync_steps": 3}})
    with pytest.raises(ValidationError, match=r"sync_ref_model works with gpus: 1 only"):
        TrainConfig.model_validate(full.model_dump() | {"gpus": 2, "loss": {"loss_type": "dapo", "beta": 0.1,
                                                                             "sync_ref_model": True}})
