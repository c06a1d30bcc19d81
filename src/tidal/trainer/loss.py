"""Policy losses as one pure function over packed token tensors (formulas: docs/algorithms.md).

Notation per loss token t of sequence i: `lp` trainer logprob (with grad), `old` the trainer's logprob at the
start of the step (recorded in the first of `num_iterations`), `inf` the logprob vLLM sampled with, `A` the
advantage times `adv_tau` (plus `teacher_tau * (teacher - lp)` when distilling).

- `aipo` (seed 000): `coeff = w * (A - kl_tau * m)` with `m = lp - inf` (detached) and `w = exp(m)`, or for
  `ratio_type: sequence` `w = min(exp(mean_i m), sequence_clip_high)`; token loss `-coeff * lp`.
- clipped (TRL / NeMo RL): `r = exp(lp - old)` (GSPO: `exp(mean_i(lp - old))`), objective
  `min(min(r, delta) * A, clip(r, 1 - eps, 1 + eps_high) * A)`, at least `c * A` when A < 0 (dual clip),
  times the IS correction `exp(old - inf)` (truncated or masked at `is_cap`); token loss `-objective`.
- both: `+ beta * k3(ref, lp)` (times `exp(lp - old)` detached for the on-policy approximation).

Masks (seed 000) on the trainer/inference ratio `exp(lp - inf)`: token ratio outside
[token_mask_low, token_mask_high]; whole sequences by geometric mean or min/max token ratio. They remove a
token from every term; the entropy mask (top_entropy_quantile) and the masked IS correction remove it from
the policy term only (TRL / NeMo RL semantics). Normalization by `loss_type` uses step-level counts
(`LossScale`), so micro-batches add up to exactly the loss of the whole step.

Returns the loss and additive sums for the step's metrics (masks, clipping, entropy, drift).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from tidal.config.train import LossConfig


@dataclass
class LossInputs:
    """(B, T) tensors of one micro-batch; `seq_ids` < 0 marks padding, `loss_mask` the trained tokens."""

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    inference_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    seq_ids: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


@dataclass
class LossScale:
    """Step-level counts the normalizations divide by."""

    step_tokens: float
    """Loss tokens in the whole step (all micro-batches)."""
    step_sequences: int
    """Samples in the step."""
    micro_batches: int
    """Micro-batches in the step (bnpo averages over them)."""
    max_completion_len: int
    """Max completion tokens (dr_grpo's constant L)."""


class LossSums(defaultdict[str, float]):
    """Additive per-micro-batch statistics; `tokens` is the denominator of the token means."""

    def __init__(self) -> None:
        super().__init__(float)

    def __iadd__(self, other: dict[str, float]) -> LossSums:  # type: ignore[override,misc]
        for k, v in other.items():
            self[k] += v
        return self


def segment_reduce(values: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int, reduce: str,
                   include_self: bool = False, init: float = 0.0) -> torch.Tensor:
    """Reduce flat `values` per sequence id (ids in [0, num_seqs)); returns (num_seqs,) tensor."""
    out = torch.full((num_seqs,), init, dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, seq_ids, values, reduce=reduce, include_self=include_self)


def _seq_mean(values: torch.Tensor, ids: torch.Tensor, num: int, count: torch.Tensor) -> torch.Tensor:
    """Mean of flat `values` per sequence (differentiable), broadcast back to tokens: (N,)."""
    sums = torch.zeros(num, dtype=values.dtype, device=values.device).index_add(0, ids, values)
    return (sums / count)[ids]


def entropy_keep(entropy: torch.Tensor, quantile: float) -> torch.Tensor:
    """Tokens whose entropy is >= the (1 - quantile) quantile of `entropy` (flat loss tokens)."""
    if quantile >= 1.0 or entropy.numel() == 0:
        return torch.ones_like(entropy, dtype=torch.bool)
    threshold = torch.quantile(entropy.double(), 1.0 - quantile)
    return entropy.double() >= threshold


def policy_loss(x: LossInputs, cfg: LossConfig, scale: LossScale) -> tuple[torch.Tensor, LossSums]:
    """Loss of one micro-batch (see module doc) and its metric sums."""
    mask = x.loss_mask.bool() & (x.seq_ids >= 0)
    lp = x.logprobs[mask]  # (N,) loss tokens only
    dt = lp.dtype
    old = x.old_logprobs[mask].to(dt)
    inf = x.inference_logprobs[mask].to(dt)
    uniq, ids = torch.unique(x.seq_ids[mask], return_inverse=True)  # compact sequence ids 0..S-1
    num = len(uniq)
    count = segment_reduce(torch.ones_like(lp), ids, num, "sum")  # (S,) loss tokens per sequence

    # seed 000 masks on the trainer/inference ratio
    m = lp.detach() - inf
    ratio = torch.exp(m)
    tok_low, tok_high = ratio < cfg.token_mask_low, ratio > cfg.token_mask_high
    geo = torch.exp(segment_reduce(m, ids, num, "sum") / count)
    seq_min = segment_reduce(ratio, ids, num, "amin", init=float("inf"))
    seq_max = segment_reduce(ratio, ids, num, "amax", init=float("-inf"))
    seq_masks = {"geo_low": geo < cfg.geo_mask_low, "geo_high": geo > cfg.geo_mask_high,
                 "sequence_low": seq_min < cfg.sequence_mask_low, "sequence_high": seq_max > cfg.sequence_mask_high}
    seq_bad = torch.zeros(num, dtype=torch.bool, device=lp.device)
    for v in seq_masks.values():
        seq_bad |= v
    keep = ~tok_low & ~tok_high & ~seq_bad[ids]

    adv = cfg.adv_tau * x.advantages[mask].to(dt)
    if cfg.teacher_tau:
        if x.teacher_logprobs is None:
            raise ValueError("loss.teacher_tau > 0 needs teacher logprobs in the batch (set orch teacher)")
        adv = adv + cfg.teacher_tau * (x.teacher_logprobs[mask].to(dt) - lp.detach())

    policy_keep = keep.clone()
    ent = x.entropy[mask] if x.entropy is not None else None
    ent_keep = entropy_keep(ent, cfg.top_entropy_quantile) if ent is not None else torch.ones_like(keep)
    policy_keep &= ent_keep
    zeros = torch.zeros_like(keep)
    is_masked = zeros
    if cfg.loss_type == "aipo":
        if cfg.ratio_type == "token":
            w, clip_high = ratio, zeros
        else:
            w = torch.clamp(geo, max=cfg.sequence_clip_high)[ids]
            clip_high = (geo > cfg.sequence_clip_high)[ids]
        coeff = w * (adv - cfg.kl_tau * m)  # detached
        objective = coeff * lp
        clip_low = zeros
    else:
        log_r = lp - old
        if cfg.importance_sampling_level == "sequence":
            log_r = _seq_mean(log_r, ids, num, count)
        r = torch.exp(log_r)
        eps_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
        c1 = r if cfg.delta is None else torch.clamp(r, max=cfg.delta)
        c2 = torch.clamp(r, 1 - cfg.epsilon, 1 + eps_high)
        objective = torch.minimum(c1 * adv, c2 * adv)
        if cfg.ratio_clip_c is not None:
            objective = torch.where(adv < 0, torch.maximum(objective, cfg.ratio_clip_c * adv), objective)
        rd = r.detach()
        clip_low, clip_high = (rd < 1 - cfg.epsilon) & (adv < 0), (rd > 1 + eps_high) & (adv > 0)
        if cfg.is_correction != "none":
            w_is = torch.exp(old - inf)
            if cfg.is_correction == "truncated":
                w_is = torch.clamp(w_is, max=cfg.is_cap)
            elif cfg.is_correction == "masked":
                is_masked = w_is > cfg.is_cap
                policy_keep &= ~is_masked
            objective = objective * w_is
    per_token = -objective * policy_keep
    kl = None
    if cfg.beta:
        if x.ref_logprobs is None:
            raise ValueError("loss.beta > 0 needs reference logprobs")
        d = x.ref_logprobs[mask].to(dt) - lp
        kl = torch.exp(d) - d - 1
        if cfg.use_on_policy_kl_approximation:
            kl = kl * torch.exp(lp.detach() - old)
        per_token = per_token + cfg.beta * kl * keep
    loss = _normalize(per_token, ids, num, count, cfg.loss_type, scale)

    sums = LossSums()
    sums += {"tokens": float(mask.sum()), "masked": float((~policy_keep).sum()),
             "masked/token_low": float(tok_low.sum()), "masked/token_high": float(tok_high.sum()),
             "masked/entropy": float((~ent_keep).sum()), "masked/is": float(is_masked.sum()),
             "clip_ratio/low_mean": float(clip_low.sum()), "clip_ratio/high_mean": float(clip_high.sum()),
             "clip_ratio/region_mean": float((clip_low | clip_high).sum())}
    sums += {f"masked/{k}": float(v[ids].sum()) for k, v in seq_masks.items()}
    sums += drift_sums(old, inf)
    if ent is not None:
        sums["entropy"] += float(ent.sum())
    if kl is not None:
        sums["kl"] += float(kl.detach().sum())
    return loss, sums


def _normalize(per_token: torch.Tensor, ids: torch.Tensor, num: int, count: torch.Tensor, loss_type: str,
               scale: LossScale) -> torch.Tensor:
    """Sum of `per_token` with the normalization of `loss_type` (see LossConfig.loss_type)."""
    total = per_token.sum()
    if loss_type in ("aipo", "dapo"):
        return total / max(scale.step_tokens, 1.0)
    if loss_type == "bnpo":
        return total / max(float(per_token.numel()), 1.0) / max(scale.micro_batches, 1)
    if loss_type == "dr_grpo":
        return total / max(scale.step_sequences * scale.max_completion_len, 1)
    per_seq = torch.zeros(num, dtype=per_token.dtype, device=per_token.device).index_add(0, ids, per_token)
    return (per_seq / count).sum() / max(scale.step_sequences, 1)  # grpo


def drift_sums(trainer_lp: torch.Tensor, inference_lp: torch.Tensor) -> dict[str, float]:
    """Sums of NeMo RL's drift metrics over flat loss tokens (divide by the token count for the means)."""
    d = (trainer_lp - inference_lp).detach().double()
    return {"mismatch_kl": float((torch.exp(d) - 1 - d).sum()),  # k3 estimate of KL(inference || trainer)
            "token_mult_prob_error": float(torch.exp(d.abs()).sum()),
            "sampling_importance_ratio": float(torch.exp(d).sum()),
            "approx_entropy": float((-torch.exp(d) * trainer_lp.detach().double()).sum())}
