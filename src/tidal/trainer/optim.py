"""AdamW over the trainable parameters and the learning-rate schedule (warmup, then constant/linear/cosine)."""

from __future__ import annotations

import logging
import math

import torch

from tidal.config.train import TrainConfig

log = logging.getLogger(__name__)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw_8bit":
        log.warning("optimizer adamw_8bit is not implemented yet; using torch AdamW")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise RuntimeError("the model has no trainable parameters (check lora_target_modules)")
    return torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                             betas=(cfg.adam_beta1, cfg.adam_beta2))


def lr_factor(step: int, kind: str, warmup_steps: int, total_steps: int | None) -> float:
    """Multiplier of `learning_rate` for optimizer step `step` (0-based): linear warmup over `warmup_steps`,
    then `kind` (train `lr_scheduler_type`: constant, linear or cosine decay to 0 at `total_steps`)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if kind == "constant" or not total_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(opt: torch.optim.Optimizer, kind: str, warmup_steps: int,
                   total_steps: int | None) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR following `lr_factor`; decaying schedules need a known number of steps."""
    if kind != "constant" and not total_steps:
        log.warning("lr_scheduler_type %s needs a step count; max_steps unknown, so the LR stays constant", kind)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, kind, warmup_steps, total_steps))
