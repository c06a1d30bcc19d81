"""MoE router replay (R3) in the trainer: the MoE blocks route each token to the experts vLLM routed it to.

Why: vLLM and the trainer compute a token's router logits with different kernels and batch shapes, so a token
near a tie between two experts can go to different experts on each side, and the trainer's logprob of a
sampled token then comes from another computation than the sampler's (a mismatch that destabilises RL on MoE
models). Replaying the sampler's top-k makes both sides use the same experts; the trainer keeps its own gate
weights over them, so the router still learns: weights = softmax(trainer's router logits) gathered at the
replayed experts, renormalised over them where the architecture renormalises its top-k (Mixtral always;
Qwen3-MoE, Qwen2-MoE and OLMoE when `norm_topk_prob`), in the dtype the architecture returns.

How: transformers 5 gives every supported architecture (`tidal.models.routes.REPLAYABLE`) a router module,
`*TopKRouter.forward(hidden (N, H)) -> (logits (N, E), weights (N, k), experts (N, k))`, whose outputs the sparse
MoE block hands to its experts. `install(model, replay)` registers a forward hook on each router (decoder layer
index from its module name, as vLLM numbers its routes) that swaps in the replayed experts and their weights; no
model code is forked. `use(model, routes)` sets the (B, T, layers, k) routes of the micro-batch about to run
(packed like its tokens, `tidal.trainer.step.packing`; -1 = no route: the router's own choice stands); they stay set
through its backward, so a checkpointed layer recomputes with the same experts. With `replay` off the hooks only
measure. Metric `router/agreement`: the share of token-layer routes (tokens with a route) where the trainer's own
top-k set equals the sampler's, counted in the training forward (with autograd), once per layer and micro-batch.

Simplification: a token without a route (the last sampled token, environment-inserted tokens, padding) is routed
by the trainer; it affects no other token's logprob but its own successors' (none for the last token).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from tidal.models.routes import REPLAYABLE

ROUTER_CLASSES = {"Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "MixtralTopKRouter", "OlmoeTopKRouter"}
"""transformers 5 router modules of the `REPLAYABLE` architectures (same forward contract)."""
ALWAYS_NORMALISED = {"MixtralTopKRouter"}
"""Routers that renormalise their top-k weights unconditionally (the others follow `norm_topk_prob`)."""
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_STATE = "_tidal_router_replay"


@dataclass
class ReplayState:
    """What the hooks read (`routes`) and count (agreement) for one model."""

    replay: bool
    """Swap in the replayed experts (False: only measure agreement)."""
    routes: torch.Tensor | None = None
    """(B*T, layers, k) int64 routes of the current micro-batch (-1: none), or None (routers untouched)."""
    counted: set[int] = field(default_factory=set)
    """Layers whose agreement was counted for the current `routes` (a checkpoint recompute counts nothing)."""
    agree: float = 0.0
    total: float = 0.0


def install(model: torch.nn.Module, replay: bool) -> int:
    """Hook every supported router of `model` (see module doc); returns the number hooked. Raises ValueError
    naming the model's MoE class when it has routers of no supported kind."""
    state = ReplayState(replay=replay)
    hooked = 0
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind.endswith("TopKRouter") and kind not in ROUTER_CLASSES:
            raise ValueError(f"router replay supports {', '.join(REPLAYABLE.values())}; this model's router is "
                             f"{kind} ({name})")
        if kind in ROUTER_CLASSES:
            match = _LAYER.search(name + ".")
            if match is None:
                raise ValueError(f"router {name}: no decoder layer index in its name")
            module.register_forward_hook(_hook(state, int(match.group(1)), kind in ALWAYS_NORMALISED))
            hooked += 1
    if not hooked:
        raise ValueError("router replay: the model has no mixture-of-experts router")
    object.__setattr__(model, _STATE, state)
    return hooked


def _hook(state: ReplayState, layer: int, always_normalise: bool) -> Any:
    def hook(module: torch.nn.Module, args: Any, output: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> Any:
        routes = state.routes
        if routes is None:
            return None
        logits, weights, own = output  # (N, E), (N, k), (N, k)
        if routes.shape[0] != logits.shape[0] or layer >= routes.shape[1]:
            raise ValueError(f"router replay: layer {layer} got {logits.shape[0]} tokens, the micro-batch's "
                             f"routes cover {routes.shape[0]} tokens x {routes.shape[1]} layers")
        want = routes[:, layer, :]  # (N, k)
        valid = (want >= 0).all(-1)  # (N,)
        if torch.is_grad_enabled() and layer not in state.counted:  # the training forward, once per layer
            state.counted.add(layer)
            same = (own.sort(-1).values == want.sort(-1).values).all(-1) & valid
            state.agree += float(same.sum())
            state.total += float(valid.sum())
        if not state.replay:
            return None
        experts = torch.where(valid[:, None], want, own)
        gate = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, experts)
        if always_normalise or getattr(module, "norm_topk_prob", False):
            gate = gate / gate.sum(dim=-1, keepdim=True)
        return logits, gate.to(weights.dtype), experts

    return hook


def state_of(model: torch.nn.Module) -> ReplayState | None:
    """The replay state `install` put on `model` (None: not installed)."""
    return getattr(model, _STATE, None)


def use(model: torch.nn.Module, routes: torch.Tensor | None) -> None:
    """Set the routes of the micro-batch about to run: (B, T, layers, k) integers, -1 = none (None: the routers
    choose). No-op on a model without `install`."""
    state = state_of(model)
    if state is None:
        return
    state.routes = None if routes is None else routes.reshape(-1, *routes.shape[-2:]).long()
    state.counted = set()


def prepare(model: torch.nn.Module, setting: bool | str, has_routes: bool, step: int) -> None:
    """Before a step's forwards: hook the routers when the batch carries routes (replaying unless train
    `router_replay` is false; measuring only then); `router_replay: true` with a batch without routes is an error."""
    if setting is True and not has_routes:
        raise ValueError(f"train router_replay is true but batch {step} carries no routed experts: the orchestrator "
                         "must ask vLLM for them (orch client.return_routed_experts, infer return_routed_experts; "
                         "tidal grpo sets both)")
    if has_routes and state_of(model) is None:
        install(model, replay=setting is not False)
    use(model, None)


def step_metrics(model: torch.nn.Module, reduce: Any) -> dict[str, float]:
    """`router/agreement` over the ranks (`reduce(dict) -> dict`, a sum); empty without router replay hooks."""
    state = state_of(model)
    if state is None:
        return {}
    sums = reduce({"agree": state.agree, "total": state.total})
    state.agree = state.total = 0.0
    state.routes = None
    if not sums["total"]:
        return {}
    return {"router/agreement": sums["agree"] / sums["total"], "router/routes": sums["total"]}
