"""The Tinker SDK's built-in losses (`tinker.types.LossFnType`) as pure functions of one datum's tensors.

Each loss takes the datum's target logprobs under the policy being trained (`lp`, with grad; shape (N,) or (N, K)
like its `target_tokens`), the datum's other `loss_fn_inputs` as tensors broadcastable to `lp`, and the request's
`loss_fn_config`; it returns the datum's loss, a scalar *summed* over tokens, as Tinker's documentation defines
every built-in loss (https://tinker-docs.thinkingmachines.ai/losses): no mean, no normalization; a request's
loss is the sum over its datums (`loss:sum`). Notation: `q` the sampling logprobs (`logprobs` input), `A` the
`advantages`, `r = exp(lp - q)`, `sg` stop-gradient.

- `cross_entropy`: `-sum(lp * weights)` (`weights` optional, default 1).
- `importance_sampling`: `-sum(r * A)`.
- `ppo`: `-sum(min(r * A, clip(r, lo, hi) * A))`; `clip_low_threshold` / `clip_high_threshold` (config or
  per-token inputs) default 0.8 / 1.2 (Tinker's documented epsilon 0.2).
- `cispo`: `-sum(sg(clip(r, lo, hi)) * lp * A)`; thresholds default 0.0 / 4.0 (Tinker's documented one-sided
  default).
- `dro`: `-sum(lp * A - beta / 2 * (lp - q)^2)`; `beta` defaults to 0.05 (tidal's choice: Tinker documents the
  key, with 0.05 as its example, but not a default).
- `gspo` (GSPO-token): the sequence log-ratio `s = mean over sequence_ratio_mask of (sg(lp) - q)`, each token's
  ratio `exp(s + lp - sg(lp))` (the sequence's value, the token's own gradient), then PPO's clipped objective on
  it; `sequence_ratio_mask` is required; thresholds default to PPO's (tidal's choice: not documented by Tinker).

Refused (`LossError`): `stable_reinforce` needs per-sequence "stability information" that Tinker's sampler
records and whose formula Tinker does not publish; `custom` is a server-side traced loss, which tidal's
`/api/v1/client/config` does not offer (so the SDK's `forward_backward_custom` runs the loss on the client, over
`cross_entropy`, and works). Input keys a loss does not take are refused like Tinker's server refuses them (the
cookbook drops its `mask` key before sending), as are unknown `loss_fn_config` keys.

tests/unit/test_tinker_losses.py checks every loss and its gradient against float64 references of the formulas.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch


class LossError(ValueError):
    """A request the built-in losses cannot run: unknown or refused loss, missing or unexpected input/config key."""


Inputs = Mapping[str, torch.Tensor]
Config = Mapping[str, float]


def _clip_bounds(inputs: Inputs, config: Config, lo: float, hi: float) -> tuple[torch.Tensor | float, ...]:
    """(low, high) thresholds: a per-token input if given, else the config value, else the loss's default."""
    low = inputs.get("clip_low_threshold", config.get("clip_low_threshold", lo))
    high = inputs.get("clip_high_threshold", config.get("clip_high_threshold", hi))
    return low, high


def _clamp(x: torch.Tensor, low: torch.Tensor | float, high: torch.Tensor | float) -> torch.Tensor:
    if isinstance(low, torch.Tensor) or isinstance(high, torch.Tensor):  # per-token thresholds
        low, high = torch.as_tensor(low, dtype=x.dtype), torch.as_tensor(high, dtype=x.dtype)
        return torch.minimum(torch.maximum(x, low), high)
    return x.clamp(low, high)


def cross_entropy(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    weights = inputs.get("weights")
    return -(lp if weights is None else lp * weights).sum()


def importance_sampling(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    ratio = torch.exp(lp - inputs["logprobs"])
    return -(ratio * inputs["advantages"]).sum()


def _ppo_objective(ratio: torch.Tensor, adv: torch.Tensor, low: torch.Tensor | float,
                   high: torch.Tensor | float) -> torch.Tensor:
    return torch.minimum(ratio * adv, _clamp(ratio, low, high) * adv)


def ppo(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    low, high = _clip_bounds(inputs, config, 0.8, 1.2)
    ratio = torch.exp(lp - inputs["logprobs"])
    return -_ppo_objective(ratio, inputs["advantages"], low, high).sum()


def cispo(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    low, high = _clip_bounds(inputs, config, 0.0, 4.0)
    coeff = _clamp(torch.exp(lp - inputs["logprobs"]), low, high).detach()  # sg(clip(r))
    return -(coeff * lp * inputs["advantages"]).sum()


def dro(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    beta = config.get("beta", 0.05)
    quadratic = (lp - inputs["logprobs"]) ** 2
    return -(lp * inputs["advantages"] - 0.5 * beta * quadratic).sum()


def gspo(lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    low, high = _clip_bounds(inputs, config, 0.8, 1.2)
    in_ratio = torch.broadcast_to(inputs["sequence_ratio_mask"] != 0, lp.shape)
    if not bool(in_ratio.any()):
        raise LossError("loss_fn 'gspo': sequence_ratio_mask marks no token of a datum (the sequence ratio is a "
                        "mean over the marked tokens)")
    log_ratio = (lp.detach() - inputs["logprobs"])[in_ratio].mean()  # scalar, no gradient
    ratio = torch.exp(log_ratio + lp - lp.detach())  # value exp(s) everywhere, d/d lp_t = exp(s)
    return -_ppo_objective(ratio, inputs["advantages"], low, high).sum()


LossFn = Callable[[torch.Tensor, Inputs, Config], torch.Tensor]


@dataclass(frozen=True)
class LossSpec:
    """A built-in loss: its function and the `loss_fn_inputs` / `loss_fn_config` keys it takes."""

    fn: LossFn
    required: frozenset[str]
    optional: frozenset[str] = frozenset()
    config: frozenset[str] = frozenset()


_RL = frozenset({"target_tokens", "logprobs", "advantages"})
_CLIPS = frozenset({"clip_low_threshold", "clip_high_threshold"})

LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, frozenset({"target_tokens"}), frozenset({"weights"})),
    "importance_sampling": LossSpec(importance_sampling, _RL),
    "ppo": LossSpec(ppo, _RL, _CLIPS, _CLIPS),
    "cispo": LossSpec(cispo, _RL, _CLIPS, _CLIPS),
    "dro": LossSpec(dro, _RL, config=frozenset({"beta"})),
    "gspo": LossSpec(gspo, _RL | {"sequence_ratio_mask"}, _CLIPS, _CLIPS),
}
"""Every loss of the SDK's `LossFnType` that tidal runs."""

STABLE_REINFORCE_FIX = (
    "tidal refuses stable_reinforce (its formula reads per-sequence stability information that Tinker's sampler "
    "records and Tinker does not publish); train with loss_fn='cispo' or 'ppo' instead: tinker-cookbook "
    "`python -m tinker_cookbook.recipes.rl_loop loss_fn=cispo` (rl_loop takes no ppo), "
    "`python -m tinker_cookbook.recipes.math_rl.train loss_fn=ppo`, rl.train's async mode `async_config.loss_fn=cispo`")
"""The one-line refusal of `stable_reinforce` with its fix: at the first forward_backward that asks for it, and at
the first sample that records stability information (`record_stability_info`, which the cookbook sets only for
stable_reinforce, and which its loops send before any training request)."""

REFUSED: dict[str, str] = {
    "stable_reinforce": STABLE_REINFORCE_FIX,
    "custom": "server-side custom losses are not offered by this server; the SDK's forward_backward_custom runs "
              "the loss on the client instead (over cross_entropy), which works here",
}
"""Losses of `LossFnType` tidal refuses, with the reason the error gives."""


def check_request(loss_fn: str, input_keys: set[str], config: Config) -> LossSpec:
    """The `LossSpec` of `loss_fn`, after checking a datum's input keys and the config's keys; `LossError` naming
    the key and what is valid otherwise."""
    if loss_fn in REFUSED:
        raise LossError(REFUSED[loss_fn] if loss_fn == "stable_reinforce" else
                        f"loss_fn '{loss_fn}' is not supported by tidal: {REFUSED[loss_fn]}")
    spec = LOSSES.get(loss_fn)
    if spec is None:
        raise LossError(f"unknown loss_fn '{loss_fn}'; valid: {', '.join(LOSSES)}")
    missing = sorted(spec.required - input_keys)
    if missing:
        raise LossError(f"loss_fn '{loss_fn}' needs loss_fn_inputs {', '.join(missing)} (takes "
                        f"{', '.join(sorted(spec.required | spec.optional))})")
    extra = sorted(input_keys - spec.required - spec.optional)
    if extra:
        raise LossError(f"loss_fn '{loss_fn}' does not take loss_fn_inputs {', '.join(extra)} (takes "
                        f"{', '.join(sorted(spec.required | spec.optional))})")
    bad = sorted(set(config) - spec.config)
    if bad:
        allowed = ", ".join(sorted(spec.config)) or "none"
        raise LossError(f"loss_fn '{loss_fn}' does not take loss_fn_config {', '.join(bad)} (takes {allowed})")
    return spec


def datum_loss(loss_fn: str, lp: torch.Tensor, inputs: Inputs, config: Config) -> torch.Tensor:
    """One datum's loss (a scalar, summed over its tokens): `lp` its target logprobs under the policy, `inputs` its
    `loss_fn_inputs` as tensors (target_tokens included; not used here), `config` the request's
    `loss_fn_config`."""
    spec = check_request(loss_fn, set(inputs), config)
    return spec.fn(lp, {k: v for k, v in inputs.items() if k != "target_tokens"}, config)
