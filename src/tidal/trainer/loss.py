"""The GRPO loss of seed 000 (Surogate / AIPO-style), as a pure function over packed token tensors.

    log_ratio = trainer_logprobs - inference_logprobs          # per token
    ratio     = exp(log_ratio)
    coeff     = ratio * (adv_tau * advantage - kl_tau * log_ratio)      (treated as a constant)
    loss      = -sum(coeff * trainer_logprobs * keep) / loss_scale

so d loss / d trainer_logprobs[t] = -coeff[t] * keep[t] / loss_scale. `keep` is the loss mask minus tokens
whose ratio is outside [token_mask_low, token_mask_high] and minus whole sequences whose geometric-mean
ratio exp(mean log_ratio) is outside [geo_mask_low, geo_mask_high], or whose smallest / largest token ratio
is below `sequence_mask_low` / above `sequence_mask_high`. `loss_scale` is the number of loss tokens in the
whole step (all micro-batches), which makes the step's loss the token-mean of the objective.

The function also returns sums for the step's metrics (mismatch KL, masked tokens), so micro-batches can be
added up exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.config.train import LossConfig


@dataclass
class LossSums:
    """Additive per-micro-batch statistics (divide by `tokens` for means)."""

    tokens: float = 0.0
    masked: float = 0.0
    masked_token: float = 0.0
    masked_sequence: float = 0.0
    mismatch_kl: float = 0.0

    def __iadd__(self, other: LossSums) -> LossSums:
        for k in self.__dict__:
            setattr(self, k, getattr(self, k) + getattr(other, k))
        return self


def segment_reduce(values: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int, reduce: str,
                   include_self: bool = False, init: float = 0.0) -> torch.Tensor:
    """Reduce flat `values` per sequence id (ids in [0, num_seqs)); returns (num_seqs,) tensor."""
    out = torch.full((num_seqs,), init, dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, seq_ids, values, reduce=reduce, include_self=include_self)


def grpo_loss(trainer_logprobs: torch.Tensor, inference_logprobs: torch.Tensor, advantages: torch.Tensor,
              loss_mask: torch.Tensor, seq_ids: torch.Tensor, cfg: LossConfig,
              loss_scale: float) -> tuple[torch.Tensor, LossSums]:
    """GRPO loss over (B, T) tensors (see module doc). `seq_ids` < 0 marks padding."""
    mask = loss_mask.bool() & (seq_ids >= 0)
    lp = trainer_logprobs[mask]  # (N,) loss tokens only
    log_ratio = lp.detach() - inference_logprobs[mask].to(lp.dtype)
    ratio = torch.exp(log_ratio)
    ids = seq_ids[mask]
    uniq, local = torch.unique(ids, return_inverse=True)  # compact ids 0..S-1
    num = len(uniq)

    token_ok = (ratio >= cfg.token_mask_low) & (ratio <= cfg.token_mask_high)
    count = segment_reduce(torch.ones_like(log_ratio), local, num, "sum")
    geo = torch.exp(segment_reduce(log_ratio, local, num, "sum") / count.clamp(min=1))
    seq_min = segment_reduce(ratio, local, num, "amin", init=float("inf"))
    seq_max = segment_reduce(ratio, local, num, "amax", init=float("-inf"))
    seq_ok = ((geo >= cfg.geo_mask_low) & (geo <= cfg.geo_mask_high)
              & (seq_min >= cfg.sequence_mask_low) & (seq_max <= cfg.sequence_mask_high))
    keep = token_ok & seq_ok[local]

    coeff = ratio * (cfg.adv_tau * advantages[mask].to(lp.dtype) - cfg.kl_tau * log_ratio)  # detached
    loss = -(coeff * lp * keep).sum() / loss_scale

    sums = LossSums(
        tokens=float(mask.sum()),
        masked=float((~keep).sum()),
        masked_token=float((~token_ok).sum()),
        masked_sequence=float((~seq_ok[local]).sum()),
        mismatch_kl=float((ratio - 1 - log_ratio).sum()),  # k3 estimate of KL(inference || trainer)
    )
    return loss, sums
