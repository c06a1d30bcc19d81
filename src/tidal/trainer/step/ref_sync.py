"""TR-DPO's reference updates (train `loss.sync_ref_model`, TRL's `SyncRefModelCallback`): after every
`ref_model_sync_steps`-th optimizer step of the run (AdamW's own step count, so a resumed run keeps the rhythm),
every weight of the KL reference moves toward the policy, `ref <- alpha x policy + (1 - alpha) x ref`.

Full fine-tuning only (the config refuses LoRA: its reference is the base with the adapters disabled, and mixing an
adapter's A and B separately does not mix their product), on one rank.
"""

from __future__ import annotations

import torch

from tidal.config.loss import LossConfig


def due(cfg: LossConfig, optimizer_step: int) -> bool:
    """Whether the reference is updated after the run's `optimizer_step`-th optimizer step (1-based)."""
    return cfg.sync_ref_model and optimizer_step > 0 and optimizer_step % cfg.ref_model_sync_steps == 0


@torch.no_grad()
def mix_reference(policy: torch.nn.Module, reference: torch.nn.Module, alpha: float) -> None:
    """`reference`'s every parameter <- alpha x the policy's + (1 - alpha) x its own (matched by name)."""
    own = dict(policy.named_parameters())
    for name, ref in reference.named_parameters():
        if name not in own:
            raise RuntimeError(f"the reference has parameter {name} the policy lacks")
        ref.mul_(1.0 - alpha).add_(own[name].detach().to(ref.dtype), alpha=alpha)


def after_optimizer_step(cfg: LossConfig, optimizer_step: int, policy: torch.nn.Module,
                         reference: torch.nn.Module | None) -> None:
    """Mix the reference if the run's `optimizer_step`-th optimizer step (just taken) is a sync step."""
    if reference is not None and due(cfg, optimizer_step):
        mix_reference(policy, reference, cfg.ref_model_mixup_alpha)
