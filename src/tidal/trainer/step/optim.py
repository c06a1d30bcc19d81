"""The optimizer over the trainable parameters (train `optimizer`) and the learning-rate schedule (warmup, then
constant/linear/cosine).

`adamw` / `adamw_torch`: torch's AdamW (two float32 moments per parameter, 8 bytes/param), its implementation chosen
by device (`adamw_kernel`): `fused=True` (one CUDA kernel for all parameters: no per-tensor launches) when every
trainable parameter is a plain CUDA tensor in a floating dtype; otherwise torch's default (foreach on CUDA, e.g.
FSDP2's DTensor shards; the per-tensor loop on CPU, unchanged). The update is the same (tests/unit/test_optim.py).
`adamw_8bit`: bitsandbytes' `AdamW8bit` — the same update rule, but both moments are stored as 8-bit codes with
one float32 absmax per block of 256 values (dynamic-tree quantization, ~2 bytes/param), dequantized for each
update and requantized after it. bitsandbytes (>= 0.50, as pyproject requires) runs it on CUDA and on CPU with
the same blockwise scheme. Tensors with fewer than `MIN_8BIT_SIZE` elements keep 32-bit moments (bitsandbytes'
default: for tiny tensors the block scales cost more than they save). Its `state_dict` holds plain uint8/float32
tensors and ints (all parameters share the two quantization maps; `tidal.trainer.state` stores a copy for each),
so checkpoints resume it exactly (tests/unit/test_optim_8bit.py). Single rank only: its kernels cannot update
FSDP2's sharded (DTensor) parameters, and the config refuses `adamw_8bit` with `gpus > 1`.
`loraplus_lr_ratio` (LoRA+): either optimizer over two parameter groups, the LoRA A matrices at the learning rate
and the B matrices at the rate times the ratio (PEFT builds the groups; tests/unit/test_loraplus.py).
"""

from __future__ import annotations

import logging
import math

import torch

from tidal.config.train import TrainConfig

log = logging.getLogger(__name__)

MIN_8BIT_SIZE = 4096
"""Parameters with fewer elements keep float32 AdamW moments under `adamw_8bit` (bitsandbytes' default)."""


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The train `optimizer` over `model`'s trainable parameters, with `learning_rate`, `weight_decay`, the
    Adam betas and `adam_epsilon` of `cfg`."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise RuntimeError("the model has no trainable parameters (check lora_target_modules)")
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    if cfg.loraplus_lr_ratio is not None:
        return loraplus(model, params, cfg, betas)
    if cfg.optimizer == "adamw_8bit":
        return adamw_8bit(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, betas=betas,
                          eps=cfg.adam_epsilon)
    return torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, betas=betas,
                             eps=cfg.adam_epsilon, **adamw_kernel(params))


def loraplus(model: torch.nn.Module, params: list[torch.nn.Parameter], cfg: TrainConfig,
             betas: tuple[float, float]) -> torch.optim.Optimizer:
    """LoRA+ (train `loraplus_lr_ratio`): PEFT's `create_loraplus_optimizer` over `model` (its trainable
    `params`) with the optimizer `optimizer` names: a group of the A matrices at `learning_rate`, one of the B
    matrices (and 1-D trainable tensors) at `learning_rate x ratio`, both with `weight_decay` (norm weights and
    biases without, PEFT's rule). PEFT's third group, LoRA on embeddings, cannot occur (tidal adapts linear
    layers only, `tidal.models.lora`); it would learn at `learning_rate`. Empty groups are dropped: the
    optimizer's groups are the ones that train."""
    from peft.optimizers import create_loraplus_optimizer

    assert cfg.loraplus_lr_ratio is not None
    kwargs: dict[str, object] = {"betas": betas, "eps": cfg.adam_epsilon, "weight_decay": cfg.weight_decay,
                                 "loraplus_weight_decay": cfg.weight_decay,
                                 "loraplus_lr_embedding": cfg.learning_rate}
    cls: type[torch.optim.Optimizer] = torch.optim.AdamW
    if cfg.optimizer == "adamw_8bit":
        import bitsandbytes as bnb

        cls = bnb.optim.AdamW8bit
        kwargs["min_8bit_size"] = MIN_8BIT_SIZE
    else:
        kwargs.update(adamw_kernel(params))
    opt = create_loraplus_optimizer(model, cls, lr=cfg.learning_rate,  # type: ignore[arg-type]
                                    loraplus_lr_ratio=cfg.loraplus_lr_ratio, **kwargs)
    opt.param_groups[:] = [g for g in opt.param_groups if g["params"]]
    return opt


def adamw_kernel(params: list[torch.nn.Parameter]) -> dict[str, bool]:
    """torch AdamW's implementation flag for `params`: `{"fused": True}` when all are plain (not DTensor) CUDA
    tensors of a floating dtype; else `{}` (torch's default: foreach on CUDA, the per-tensor loop on CPU)."""
    plain = all(type(p) is torch.nn.Parameter or type(p) is torch.Tensor for p in params)
    if plain and all(p.device.type == "cuda" and p.dtype.is_floating_point for p in params):
        return {"fused": True}
    return {}


def adamw_8bit(params: list[torch.nn.Parameter], lr: float, weight_decay: float,
               betas: tuple[float, float], eps: float = 1e-8) -> torch.optim.Optimizer:
    """bitsandbytes' blockwise 8-bit AdamW (decoupled weight decay)."""
    import bitsandbytes as bnb

    opt: torch.optim.Optimizer = bnb.optim.AdamW8bit(params, lr=lr, betas=betas, eps=eps,
                                                     weight_decay=weight_decay, min_8bit_size=MIN_8BIT_SIZE)
    return opt


def lr_factor(step: float, kind: str, warmup_steps: int, total_steps: int | None, cycles: float = 0.5) -> float:
    """Multiplier of `learning_rate` for optimizer step `step` (0-based): linear warmup over `warmup_steps`,
    then `kind` (train `lr_scheduler_type`: constant, linear or cosine decay to 0 at `total_steps`; the cosine
    makes `cycles` waves, train `lr_cosine_cycles`, as transformers' `num_cycles`)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if kind == "constant" or not total_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if kind == "linear":
        return 1.0 - progress
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 2.0 * cycles * progress)))


def make_scheduler(opt: torch.optim.Optimizer, kind: str, warmup_steps: int,
                   total_steps: int | None, cycles: float = 0.5) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR following `lr_factor`; decaying schedules need a known number of steps."""
    if kind != "constant" and not total_steps:
        log.warning("lr_scheduler_type %s needs a step count; max_steps unknown, so the LR stays constant", kind)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, kind, warmup_steps, total_steps, cycles))
