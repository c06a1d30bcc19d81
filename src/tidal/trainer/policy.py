"""The policy being trained, whole: model (sharded across ranks or not), rank 0's unsharded view of it,
optimizer and LR schedule; built, checkpointed and restored here at any number of ranks.

With one rank the view is the model itself. With several (`tidal.trainer.distributed`), the model is FSDP2-
sharded and rank 0 keeps a plain CPU copy, the view, that `sync_view` refreshes from the gathered trainable
parameters after every step: publishing, the NCCL push, exports and checkpoints read the view, so they are the
single-rank code. Checkpoints hold full tensors (optimizer state keyed by parameter name, `tidal.trainer.ckpt`)
and the adaptive entropy coefficient's state, and restore into any number of ranks: rank 0 reads the files and
broadcasts.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tidal.config.train import TrainConfig
from tidal.trainer import distributed as dist
from tidal.trainer.distributed import Ranks
from tidal.trainer.model.load import load_policy, load_tokenizer
from tidal.trainer.step.entropy_control import EntropyControl
from tidal.trainer.step.optim import make_optimizer, make_scheduler

log = logging.getLogger("tidal.trainer")


@dataclass
class Policy:
    """The model being trained and what steps it."""

    model: torch.nn.Module
    """What trains: FSDP2-sharded with several ranks."""
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    device: torch.device
    tokenizer: Any
    pad_id: int
    ranks: Ranks
    view: torch.nn.Module | None
    """Rank 0: the unsharded policy (the model itself with one rank); None on the other ranks."""
    reference: torch.nn.Module | None = None
    """Full fine-tuning with `loss.beta > 0`: the frozen initial model, mixed toward the policy every
    `loss.ref_model_sync_steps` optimizer steps with `loss.sync_ref_model` (with LoRA the reference is the model
    with its adapters disabled, no copy)."""
    entropy: EntropyControl | None = None
    """The entropy bonus's coefficient across the run's steps (`loss.use_adaptive_entropy`)."""


def build_policy(cfg: TrainConfig, total_steps: int | None, ranks: Ranks = dist.SINGLE) -> Policy:
    """The LoRA policy, AdamW and the LR schedule per `cfg` (before any resume), sharded over `ranks`."""
    tok = load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code, chat_template=cfg.chat_template)
    model, device = load_policy(cfg)
    view: torch.nn.Module | None = model
    if ranks.sharded:
        view = copy.deepcopy(model).to("cpu") if ranks.main else None
        dist.shard(model, cfg.zero_level)
    opt = make_optimizer(model, cfg)
    sched = make_scheduler(opt, cfg.lr_scheduler_type, cfg.warmup_steps, total_steps, cfg.lr_cosine_cycles)
    return Policy(model, opt, sched, device, tok, tok.pad_token_id if tok.pad_token_id is not None else 0, ranks,
                  view, reference_model(cfg, ranks), EntropyControl(cfg.loss.entropy_coef))


def reference_model(cfg: TrainConfig, ranks: Ranks) -> torch.nn.Module | None:
    """The frozen reference for the KL term of a fully fine-tuned policy (a second copy of the weights, sharded
    like the policy); None with LoRA or without a KL term."""
    if cfg.lora or not cfg.loss.beta:
        return None
    ref, _ = load_policy(cfg.model_copy(update={"gradient_checkpointing": False}))
    ref.requires_grad_(False)
    ref.eval()
    if ranks.sharded:
        dist.shard(ref, cfg.zero_level)
    return ref


def sync_view(p: Policy) -> None:
    """After an optimizer step with several ranks: the trainable parameters into rank 0's view (collective)."""
    if not p.ranks.sharded:
        return
    full = dist.gather_trainable(p.ranks, p.model)
    if p.view is not None and full is not None:
        dist.refresh_view(p.view, full)


def save(p: Policy, run_dir: Path, step: int, cfg: TrainConfig) -> None:
    """Checkpoint `step` (collective: every rank calls it; rank 0 writes)."""
    from tidal.trainer.ckpt import save_trainer

    optimizer = dist.optimizer_state(p.ranks, p.model, p.opt)
    rngs = dist.rng_states(p.ranks)
    if p.ranks.main:
        assert p.view is not None and optimizer is not None
        save_trainer(run_dir, step, p.view, optimizer, p.sched, cfg.ckpt, rngs,
                     p.entropy.state() if p.entropy is not None else None,
                     p.reference if cfg.loss.sync_ref_model else None)


def restore(p: Policy, run_dir: Path, step: int) -> None:
    """Load checkpoint `step` into every rank (collective; rank 0 reads the files)."""
    from tidal.checkpoint import CheckpointError
    from tidal.paths import ckpt_dir
    from tidal.trainer.ckpt import COMPONENT, REFERENCE, load_full_weights, load_trainer

    state: dict[str, Any] = {"optimizer": None, "rank_rngs": None, "entropy_control": None}
    if p.ranks.main:
        assert p.view is not None
        state = load_trainer(run_dir, step, p.view, p.sched)
    if p.ranks.sharded:
        trainable = ({n: q.detach() for n, q in p.view.named_parameters() if q.requires_grad}
                     if p.view is not None else None)
        dist.load_trainable(p.ranks, p.model, trainable)
        if not p.ranks.main:  # the LR is a function of the step (grpo._set_lr): the other ranks need only that
            p.sched.last_epoch = step
    try:
        dist.load_optimizer_state(p.ranks, p.model, p.opt, state["optimizer"])
    except (ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint step {step} under {run_dir}: the optimizer state does not fit this "
                              f"model ({exc})") from exc
    dist.set_rng_states(p.ranks, state["rank_rngs"])
    restore_entropy(p, state["entropy_control"])
    saved_ref = ckpt_dir(run_dir, COMPONENT, step) / REFERENCE
    if p.reference is not None and saved_ref.is_dir():  # `loss.sync_ref_model`: the reference moved (one rank)
        if p.ranks.sharded:
            raise CheckpointError(f"{saved_ref} holds a reference moved by loss.sync_ref_model, which restores into "
                                  f"one rank only (gpus: 1)")
        load_full_weights(p.reference, saved_ref)


def restore_entropy(p: Policy, saved: dict[str, Any] | None) -> None:
    """Rank 0's checkpointed entropy-control state into every rank (collective); a checkpoint without one (written
    before it was kept) leaves the coefficient at `entropy_coef`."""
    if p.ranks.sharded:
        raw = dist.broadcast_bytes(p.ranks, json.dumps(saved).encode() if p.ranks.main else None)
        saved = json.loads(raw) if raw is not None else None
    if saved is not None and p.entropy is not None:
        p.entropy.load(saved)
