"""Policy losses as small pure functions over packed token tensors (formulas: docs/algorithms.md).

Notation per loss token t of sequence i: `lp` trainer logprob (with grad), `old` the trainer's logprob at the
start of the step (recorded in the first of `num_iterations`), `inf` the logprob vLLM sampled with, `A` the
advantage times `adv_tau` (plus `teacher_tau * (teacher - lp)` when distilling).

- `aipo` (seed 000): `coeff = w * (A - kl_tau * m)` with `m = lp - inf` (detached) and `w = exp(m)`, or for
  `ratio_type: sequence` `w = min(exp(mean_i m), sequence_clip_high)`; token loss `-coeff * lp`.
- TRL 1.16's types, with `r = exp(lp - old)` (GSPO: `exp(mean_i(lp - old))`): clipped (grpo, bnpo, dr_grpo,
  dapo, luspo; NeMo RL) `min(min(r, delta) * A, clip(r, 1 - eps, 1 + eps_high) * A)`, at least `c * A` when
  A < 0 (dual clip); cispo `sg(min(r, eps_high)) * A * lp`; sapo `4 / tau * sigmoid(tau (r - 1)) * A`; each
  times the IS correction `exp(old - inf)` (`is_correction`: as is, truncated or masked to
  [is_cap_min, is_cap], per token or per sequence); vespo `sg(phi(w)) * A * lp` with the Gamma weight of the
  sequence ratio w (the token IS weights folded into w). Token loss `-objective`; DeepSeek-V3.2's off-policy
  sequence mask (`off_policy_mask_threshold`) drops negative-advantage sequences far from the inference policy.
- both: `+ beta * k3(ref, lp)` (times `exp(lp - old)` detached for the on-policy approximation, times `r`
  with its gradient for TRL's `use_bias_correction_kl`).

Masks (seed 000) on the trainer/inference ratio `exp(lp - inf)`: token ratio outside
[token_mask_low, token_mask_high]; whole sequences by geometric mean or min/max token ratio. They remove a
token from every term; the entropy mask (top_entropy_quantile) and the masked IS correction remove it from
the policy term only (TRL / NeMo RL semantics). Normalization by `loss_type` uses step-level counts
(`LossScale`), so micro-batches add up to exactly the loss of the whole step.

`policy_loss` composes the parts, each pure over flat (N,) loss-token / (S,) per-sequence tensors:
`token_view` (the loss tokens of `LossInputs`, advantages scaled), `ratio_masks` (the seed 000 masks),
`aipo_objective` or `trl_objective` (`clipped_ratio`, then `clipped_objective`, `cispo_objective`,
`sapo_objective` or `vespo_objective`, and `is_corrected`), `off_policy_keep`, `kl_term`, `_normalize`
(by `loss_type`) and `loss_metrics`: the loss and additive sums for the step's metrics (masks, clipping,
entropy, drift).
"""

from __future__ import annotations

import math
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


def policy_loss(x: LossInputs, cfg: LossConfig, scale: LossScale,
                entropy_coef: float | None = None) -> tuple[torch.Tensor, LossSums]:
    """Loss of one micro-batch (see module doc) and its metric sums; `entropy_coef`: the entropy bonus's
    coefficient of this optimizer step (`tidal.trainer.step.entropy_control`; None: `cfg.entropy_coef`)."""
    v = token_view(x, cfg)
    masks = ratio_masks(v, cfg)
    obj = aipo_objective(v, masks, cfg) if cfg.loss_type == "aipo" else trl_objective(v, cfg)
    ent_keep = (entropy_keep(v.entropy, cfg.top_entropy_quantile) if v.entropy is not None
                else torch.ones_like(masks.keep))
    policy_keep = masks.keep & ent_keep & ~obj.is_masked & off_policy_keep(v, cfg)
    per_token = -obj.value * policy_keep
    kl = kl_term(v, cfg)
    if kl is not None:
        per_token = per_token + cfg.beta * kl * masks.keep
    loss = _normalize(per_token, v.ids, v.num, v.count, cfg.loss_type, scale)
    sums = loss_metrics(v, masks, obj, ent_keep, policy_keep, kl)
    if cfg.entropy_coef or cfg.use_adaptive_entropy:
        coef = cfg.entropy_coef if entropy_coef is None else entropy_coef
        loss = loss - coef * entropy_bonus(v, masks.keep & ent_keep, scale)
        if v.entropy is not None:  # the adaptive controller's window (not a metric: the `_` prefix)
            sums += {"_entropy_bonus/sum": float((v.entropy.detach() * (masks.keep & ent_keep)).sum()),
                     "_entropy_bonus/tokens": float((masks.keep & ent_keep).sum())}
    return loss, sums


def zero_gradient(advantages: torch.Tensor, loss_mask: torch.Tensor, cfg: LossConfig) -> bool:
    """True when `policy_loss` of a micro-batch with these (B, T) advantages has exactly zero gradient, whatever its
    logprobs: every loss token's advantage is 0 and no term without the advantage is on (`beta`'s KL, the entropy
    bonus, `teacher_tau`'s distillation, aipo's `kl_tau`). Every objective is the advantage times a factor
    (clipped, dual clip, cispo, sapo, vespo, aipo with `kl_tau` 0) and the masks, IS corrections and
    normalizations multiply it, so such a micro-batch's backward adds zeros (train `skip_zero_gradient`;
    tests/unit/test_zero_gradient.py checks every loss_type x is_correction in float64)."""
    return advantage_only(cfg) and not bool((advantages[loss_mask.bool()] != 0).any())


def advantage_only(cfg: LossConfig) -> bool:
    """No term of the loss has a gradient without the advantage (`zero_gradient`)."""
    return not (cfg.beta or cfg.entropy_coef or cfg.use_adaptive_entropy or cfg.teacher_tau
                or (cfg.loss_type == "aipo" and cfg.kl_tau))


def entropy_bonus(v: TokenView, keep: torch.Tensor, scale: LossScale) -> torch.Tensor:
    """TRL 1.16's entropy bonus of one micro-batch: the mean entropy (with its gradient) of the `keep` (N,) tokens,
    divided by the micro-batches of the optimizer step, so the step's bonus is their average."""
    if v.entropy is None:
        raise ValueError("loss.entropy_coef needs the token entropies (with their gradient)")
    ent = v.entropy.to(v.lp.dtype)
    return (ent * keep).sum() / max(float(keep.sum()), 1.0) / max(scale.micro_batches, 1)


@dataclass
class TokenView:
    """The loss tokens of one micro-batch, flat: (N,) tensors in the trainer's dtype (entropy as given)."""

    lp: torch.Tensor
    """(N,) trainer logprobs, with grad."""
    old: torch.Tensor
    """(N,) trainer logprobs at the start of the step."""
    inf: torch.Tensor
    """(N,) inference logprobs."""
    adv: torch.Tensor
    """(N,) `adv_tau * A` (plus the teacher term), detached."""
    ids: torch.Tensor
    """(N,) compact sequence ids in [0, num)."""
    num: int
    """S, the number of sequences with loss tokens."""
    count: torch.Tensor
    """(S,) loss tokens per sequence."""
    ref: torch.Tensor | None
    """(N,) reference logprobs, if given."""
    entropy: torch.Tensor | None
    """(N,) token entropies, if given."""


@dataclass
class RatioMasks:
    """Seed 000's masks on the trainer/inference ratio, and the ratios aipo weights by."""

    m: torch.Tensor
    """(N,) detached log ratio `lp - inf`."""
    ratio: torch.Tensor
    """(N,) `exp(m)`."""
    geo: torch.Tensor
    """(S,) geometric-mean ratio per sequence."""
    tok_low: torch.Tensor
    """(N,) token ratio below token_mask_low."""
    tok_high: torch.Tensor
    """(N,) token ratio above token_mask_high."""
    seq: dict[str, torch.Tensor]
    """(S,) sequence masks by name (geo_low, geo_high, sequence_low, sequence_high)."""
    keep: torch.Tensor
    """(N,) tokens no mask removes."""


@dataclass
class Objective:
    """Per-token objective to maximize, (N,), and its (N,) bool indicators."""

    value: torch.Tensor
    clip_low: torch.Tensor
    clip_high: torch.Tensor
    is_masked: torch.Tensor
    """Tokens the masked IS correction drops from the policy term."""
    is_weight: torch.Tensor | None = None
    """(N,) the IS correction's weight of each token (0 where masked), if one is applied."""
    is_sequence: bool = False
    """`is_weight` is one weight per sequence (the `sequence_*` corrections)."""
    phi: torch.Tensor | None = None
    """(N,) vespo's sequence weight, broadcast to the tokens."""


def token_view(x: LossInputs, cfg: LossConfig) -> TokenView:
    """The loss tokens of `x` (trained and not padding) as flat (N,) tensors."""
    mask = x.loss_mask.bool() & (x.seq_ids >= 0)
    lp = x.logprobs[mask]  # (N,) loss tokens only
    dt = lp.dtype
    uniq, ids = torch.unique(x.seq_ids[mask], return_inverse=True)  # compact sequence ids 0..S-1
    num = len(uniq)
    count = segment_reduce(torch.ones_like(lp), ids, num, "sum")  # (S,) loss tokens per sequence
    return TokenView(lp=lp, old=x.old_logprobs[mask].to(dt), inf=x.inference_logprobs[mask].to(dt),
                     adv=_advantage(x, mask, lp, cfg), ids=ids, num=num, count=count,
                     ref=x.ref_logprobs[mask].to(dt) if x.ref_logprobs is not None else None,
                     entropy=x.entropy[mask] if x.entropy is not None else None)


def _advantage(x: LossInputs, mask: torch.Tensor, lp: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """(N,) `adv_tau * A + teacher_tau * (teacher - lp)` (lp detached)."""
    adv = cfg.adv_tau * x.advantages[mask].to(lp.dtype)
    if cfg.teacher_tau:
        if x.teacher_logprobs is None:
            raise ValueError("loss.teacher_tau > 0 needs teacher logprobs in the batch (set orch teacher)")
        adv = adv + cfg.teacher_tau * (x.teacher_logprobs[mask].to(lp.dtype) - lp.detach())
    return adv


def ratio_masks(v: TokenView, cfg: LossConfig) -> RatioMasks:
    """Seed 000's token (N,) and sequence (S,) masks on `exp(lp - inf)`; `keep` (N,) passes all of them."""
    m = v.lp.detach() - v.inf
    ratio = torch.exp(m)
    tok_low, tok_high = ratio < cfg.token_mask_low, ratio > cfg.token_mask_high
    geo = torch.exp(segment_reduce(m, v.ids, v.num, "sum") / v.count)
    seq_min = segment_reduce(ratio, v.ids, v.num, "amin", init=float("inf"))
    seq_max = segment_reduce(ratio, v.ids, v.num, "amax", init=float("-inf"))
    seq = {"geo_low": geo < cfg.geo_mask_low, "geo_high": geo > cfg.geo_mask_high,
           "sequence_low": seq_min < cfg.sequence_mask_low, "sequence_high": seq_max > cfg.sequence_mask_high}
    seq_bad = torch.zeros(v.num, dtype=torch.bool, device=v.lp.device)
    for s in seq.values():
        seq_bad |= s
    keep = ~tok_low & ~tok_high & ~seq_bad[v.ids]
    return RatioMasks(m=m, ratio=ratio, geo=geo, tok_low=tok_low, tok_high=tok_high, seq=seq, keep=keep)


def aipo_objective(v: TokenView, masks: RatioMasks, cfg: LossConfig) -> Objective:
    """Seed 000's `w * (A - kl_tau * m) * lp` (N,), coefficient detached; clip_high: sequence ratio clipped."""
    zeros = torch.zeros_like(masks.keep)
    if cfg.ratio_type == "token":
        w, clip_high = masks.ratio, zeros
    else:
        w = torch.clamp(masks.geo, max=cfg.sequence_clip_high)[v.ids]
        clip_high = (masks.geo > cfg.sequence_clip_high)[v.ids]
    coeff = w * (v.adv - cfg.kl_tau * masks.m)  # detached
    return Objective(value=coeff * v.lp, clip_low=zeros, clip_high=clip_high, is_masked=zeros)


def clipped_ratio(v: TokenView, cfg: LossConfig) -> torch.Tensor:
    """(N,) ratio to the old policy `exp(lp - old)`, or GSPO's `exp(mean_i(lp - old))` per sequence."""
    log_r = v.lp - v.old
    if cfg.importance_sampling_level == "sequence":
        log_r = _seq_mean(log_r, v.ids, v.num, v.count)
    return torch.exp(log_r)


def trl_objective(v: TokenView, cfg: LossConfig) -> Objective:
    """The per-token objective (N,) of TRL's loss types, times the IS correction (vespo folds it in)."""
    r = clipped_ratio(v, cfg)
    if cfg.loss_type == "vespo":
        return vespo_objective(v, cfg)
    if cfg.loss_type == "cispo":
        obj = cispo_objective(r, v.adv, v.lp, _eps_high(cfg))
    elif cfg.loss_type == "sapo":
        obj = sapo_objective(r, v.adv, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
    else:
        obj = clipped_objective(r, v.adv, cfg)
    value, is_masked, w_is = is_corrected(obj.value, v, cfg)
    return Objective(value=value, clip_low=obj.clip_low, clip_high=obj.clip_high, is_masked=is_masked,
                     is_weight=w_is, is_sequence=cfg.is_correction.startswith("sequence"))


def _eps_high(cfg: LossConfig) -> float:
    return cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high


def clipped_objective(r: torch.Tensor, adv: torch.Tensor, cfg: LossConfig) -> Objective:
    """TRL's clipped objective (N,) of ratios `r` and advantages `adv`, with two-sided (delta) and dual clip."""
    eps_high = _eps_high(cfg)
    c1 = r if cfg.delta is None else torch.clamp(r, max=cfg.delta)
    c2 = torch.clamp(r, 1 - cfg.epsilon, 1 + eps_high)
    objective = torch.minimum(c1 * adv, c2 * adv)
    if cfg.ratio_clip_c is not None:
        objective = torch.where(adv < 0, torch.maximum(objective, cfg.ratio_clip_c * adv), objective)
    rd = r.detach()
    clip_low, clip_high = (rd < 1 - cfg.epsilon) & (adv < 0), (rd > 1 + eps_high) & (adv > 0)
    return Objective(value=objective, clip_low=clip_low, clip_high=clip_high, is_masked=torch.zeros_like(clip_low))


def cispo_objective(r: torch.Tensor, adv: torch.Tensor, lp: torch.Tensor, cap: float) -> Objective:
    """CISPO (MiniMax-M1): `min(r, cap) * A * lp` (N,), the capped ratio detached; clip_high: r > cap, A > 0."""
    rd = r.detach()
    clip_high = (rd > cap) & (adv > 0)
    return Objective(value=torch.clamp(rd, max=cap) * adv * lp, clip_low=torch.zeros_like(clip_high),
                     clip_high=clip_high, is_masked=torch.zeros_like(clip_high))


def sapo_objective(r: torch.Tensor, adv: torch.Tensor, tau_pos: float, tau_neg: float) -> Objective:
    """SAPO's soft gate `4 / tau * sigmoid(tau * (r - 1)) * A` (N,); tau_pos where A > 0, else tau_neg."""
    tau = torch.where(adv > 0, torch.full_like(r, tau_pos), torch.full_like(r, tau_neg))
    none = torch.zeros_like(adv, dtype=torch.bool)
    return Objective(value=torch.sigmoid(tau * (r - 1)) * 4 / tau * adv, clip_low=none, clip_high=none,
                     is_masked=none)


LOG_MIN_W = math.log(1e-8)
"""vespo clamps log weights to [log 1e-8, 20] (VESPO's reference code)."""


def gamma_weights(log_w: torch.Tensor, adv: torch.Tensor, k_pos: float, lam_pos: float, k_neg: float,
                  lam_neg: float) -> torch.Tensor:
    """VESPO's `phi(w) = exp(lambda + k log w - lambda w)` (S,) of sequence log weights `log_w` (clamped to
    [log 1e-8, 20]); (k, lambda) by the sign of the sequence's advantage (A >= 0: the `pos` pair)."""
    log_w = torch.clamp(log_w, LOG_MIN_W, 20.0)
    pos = adv >= 0
    k = torch.where(pos, torch.full_like(log_w, k_pos), torch.full_like(log_w, k_neg))
    lam = torch.where(pos, torch.full_like(log_w, lam_pos), torch.full_like(log_w, lam_neg)).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo_objective(v: TokenView, cfg: LossConfig) -> Objective:
    """VESPO: `phi(w) * A * lp` (N,), phi detached; log w = sum_i clamp(lp - old, +-20) plus the sum of the
    clamped log IS weights (token modes) over the sequence."""
    with torch.no_grad():
        log_w = segment_reduce(torch.clamp(v.lp.detach() - v.old, -20.0, 20.0), v.ids, v.num, "sum", init=0.0)
        _, is_masked, w_is = is_corrected(torch.zeros_like(v.old), v, cfg)
        if w_is is not None:
            log_w = log_w + segment_reduce(torch.clamp(torch.log(w_is), LOG_MIN_W, 20.0), v.ids, v.num, "sum")
        seq_adv = segment_reduce(v.adv.detach(), v.ids, v.num, "sum") / v.count  # (S,) A of each sequence
        phi = gamma_weights(log_w, seq_adv, cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg,
                            cfg.vespo_lambda_neg)[v.ids]  # (N,)
    none = torch.zeros_like(is_masked)
    return Objective(value=phi * v.adv * v.lp, clip_low=none, clip_high=none, is_masked=none, phi=phi,
                     is_weight=w_is)


def is_corrected(objective: torch.Tensor, v: TokenView,
                 cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`objective` (N,) times the IS weight `exp(old - inf)` per `is_correction` (per token, or one per sequence:
    exp of the sum), the (N,) tokens a masked mode drops, and the (N,) weights (0 where masked; None: off)."""
    is_masked = torch.zeros_like(v.lp, dtype=torch.bool)
    if cfg.is_correction == "none":
        return objective, is_masked, None
    log_w = v.old - v.inf
    if cfg.is_correction.startswith("sequence"):
        log_w = segment_reduce(log_w, v.ids, v.num, "sum")[v.ids]
    w_is = torch.exp(log_w)
    low = -math.inf if cfg.is_cap_min is None else cfg.is_cap_min
    if cfg.is_correction.endswith("truncated"):
        w_is = torch.clamp(w_is, min=cfg.is_cap_min, max=cfg.is_cap)
    elif cfg.is_correction.endswith("masked"):
        is_masked = (w_is > cfg.is_cap) | (w_is < low)
        w_is = w_is.masked_fill(is_masked, 0.0)
    return objective * w_is, is_masked, w_is


def off_policy_keep(v: TokenView, cfg: LossConfig) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (N,): False for the tokens of a sequence with a negative advantage
    whose mean `inf - lp` (detached; a KL estimate) exceeds `off_policy_mask_threshold`."""
    if cfg.off_policy_mask_threshold is None:
        return torch.ones_like(v.lp, dtype=torch.bool)
    kl = segment_reduce(v.inf - v.lp.detach(), v.ids, v.num, "sum") / v.count  # (S,)
    return ((v.adv >= 0) | (kl <= cfg.off_policy_mask_threshold)[v.ids])


def kl_term(v: TokenView, cfg: LossConfig) -> torch.Tensor | None:
    """(N,) k3 estimate of KL to the reference (on-policy approximation: times `exp(lp - old)` detached)."""
    if not cfg.beta:
        return None
    if v.ref is None:
        raise ValueError("loss.beta > 0 needs reference logprobs")
    d = v.ref - v.lp
    kl = torch.exp(d) - d - 1
    if cfg.use_on_policy_kl_approximation:
        kl = kl * torch.exp(v.lp.detach() - v.old)
    if cfg.use_bias_correction_kl:
        kl = kl * clipped_ratio(v, cfg)  # TRL 1.16: the ratio with its gradient
    return kl


def loss_metrics(v: TokenView, masks: RatioMasks, obj: Objective, ent_keep: torch.Tensor,
                 policy_keep: torch.Tensor, kl: torch.Tensor | None) -> LossSums:
    """Additive metric sums of one micro-batch from its (N,) masks and indicators."""
    sums = LossSums()
    sums += {"tokens": float(v.lp.numel()), "masked": float((~policy_keep).sum()),
             "masked/token_low": float(masks.tok_low.sum()), "masked/token_high": float(masks.tok_high.sum()),
             "masked/entropy": float((~ent_keep).sum()), "masked/is": float(obj.is_masked.sum()),
             "clip_ratio/low_mean": float(obj.clip_low.sum()), "clip_ratio/high_mean": float(obj.clip_high.sum()),
             "clip_ratio/region_mean": float((obj.clip_low | obj.clip_high).sum())}
    sums += {f"masked/{k}": float(s[v.ids].sum()) for k, s in masks.seq.items()}
    sums += drift_sums(v.old, v.inf)
    if v.entropy is not None:
        sums["entropy"] += float(v.entropy.detach().sum())
    if kl is not None:
        sums["kl"] += float(kl.detach().sum())
    sums["sequences"] += float(v.num)
    if obj.is_weight is not None:  # per sequence in the sequence modes (TRL's metric), else per token
        seq_level, w = obj.is_sequence, obj.is_weight.detach()
        sums["is_weight/sequence_mean" if seq_level else "is_weight/mean"] += float(
            segment_reduce(w, v.ids, v.num, "amax").sum() if seq_level else w.sum())
    if obj.phi is not None:
        sums["vespo/phi_seq_mean"] += float(segment_reduce(obj.phi, v.ids, v.num, "amax").sum())
    return sums


PER_SEQUENCE = ("vespo/phi_seq_mean", "is_weight/sequence_mean")
"""Metric sums over sequences (divide by the `sequences` sum); the others are over tokens (`tokens`)."""



def _normalize(per_token: torch.Tensor, ids: torch.Tensor, num: int, count: torch.Tensor, loss_type: str,
               scale: LossScale) -> torch.Tensor:
    """Sum of `per_token` with the normalization of `loss_type` (see LossConfig.loss_type)."""
    total = per_token.sum()
    if loss_type in ("aipo", "dapo", "cispo", "vespo"):
        return total / max(scale.step_tokens, 1.0)
    if loss_type == "bnpo":
        return total / max(float(per_token.numel()), 1.0) / max(scale.micro_batches, 1)
    if loss_type == "dr_grpo":
        return total / max(scale.step_sequences * scale.max_completion_len, 1)
    if loss_type == "luspo":
        return total / max(scale.step_sequences, 1)
    per_seq = torch.zeros(num, dtype=per_token.dtype, device=per_token.device).index_add(0, ids, per_token)
    return (per_seq / count).sum() / max(scale.step_sequences, 1)  # grpo, sapo


def drift_sums(trainer_lp: torch.Tensor, inference_lp: torch.Tensor) -> dict[str, float]:
    """Sums of NeMo RL's drift metrics over flat loss tokens (divide by the token count for the means)."""
    d = (trainer_lp - inference_lp).detach().double()
    return {"mismatch_kl": float((torch.exp(d) - 1 - d).sum()),  # k3 estimate of KL(inference || trainer)
            "token_mult_prob_error": float(torch.exp(d.abs()).sum()),
            "sampling_importance_ratio": float(torch.exp(d).sum()),
            "approx_entropy": float((-torch.exp(d) * trainer_lp.detach().double()).sum())}
