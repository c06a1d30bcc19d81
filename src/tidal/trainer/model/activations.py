"""Activation memory of the decoder layers: which layers gradient checkpointing recomputes, what it recomputes, and
where the kept activations live (train `gradient_checkpointing`, `checkpoint_every`, `checkpoint_scope`,
`offload_activations`). (`compile_layers` is `tidal.trainer.model.kernels`.)

Without checkpointing, HF + PEFT keep about 90 KB per token per layer of a Qwen3-0.6B in bfloat16 (57 GiB for a
16k-token row; issue 27); checkpointing every layer keeps only each layer's input and recomputes the layer in the
backward (about a third more compute). The points in between:
- `checkpoint_every: k`: transformers' per-layer switch (`GradientCheckpointingLayer.gradient_checkpointing`) is
  left on for layers 0, k, 2k, ... and turned off for the others: 1/k of the recompute, and the activations of
  the layers in between kept.
- `checkpoint_scope: mlp`: no layer-level checkpoint; the MLP block of each selected layer runs under
  `torch.utils.checkpoint` (non-reentrant): its 4 x intermediate-size values per token (gate, up, activation,
  product, plus LoRA's inputs) are recomputed, the attention's are kept — most of the memory for the cheaper
  part of the recompute (the attention is not run twice).
- `offload_activations`: the layers not checkpointed at layer level run under
  `torch.autograd.graph.save_on_cpu(pin_memory=...)`: what they save for the backward is copied to (pinned) host
  memory and back when the backward needs it. It trades PCIe traffic for device memory; with a layer-level
  checkpoint a layer saves only its input, so offloading there is refused by the config.

Gradients are those of no checkpointing (tests/unit/test_activations.py checks them in float64 on CPU).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tidal.config.load import ConfigError


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: transformers' checkpointable layers, in order (vision towers' excluded when
    the model has a language model)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers: list[tuple[str, torch.nn.Module]] = [
        (n, m) for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]
    text = [m for n, m in layers if "vision" not in n and "visual" not in n]
    return text or [m for _, m in layers]


def _checkpointed_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`module`'s own forward under a non-reentrant checkpoint when training with gradients."""
    forward = functools.partial(type(module).forward, module)
    if module.training and torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint

        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return forward(*args, **kwargs)


def _offloaded_forward(module: torch.nn.Module, pin: bool, *args: Any, **kwargs: Any) -> Any:
    """`module`'s own forward with what it saves for the backward kept in host memory."""
    with torch.autograd.graph.save_on_cpu(pin_memory=pin):
        return type(module).forward(module, *args, **kwargs)


def apply_activation_policy(model: torch.nn.Module, cfg: Any, device: torch.device) -> dict[str, int]:
    """Apply train `checkpoint_every`, `checkpoint_scope` and `offload_activations` to `model` (after
    `enable_gradient_checkpointing` when `cfg.gradient_checkpointing`; before PEFT wraps it: the patched forwards
    call the layers' submodules at run time, LoRA included). Returns how many layers got each treatment."""
    layers = decoder_layers(model)
    counts = {"layer": 0, "mlp": 0, "offload": 0}
    for i, layer in enumerate(layers):
        selected = cfg.gradient_checkpointing and i % cfg.checkpoint_every == 0
        whole = selected and cfg.checkpoint_scope == "layer"
        if cfg.gradient_checkpointing:
            layer.gradient_checkpointing = whole  # transformers' per-layer switch
        counts["layer"] += whole
        if selected and cfg.checkpoint_scope == "mlp":
            mlp = getattr(layer, "mlp", None)
            if not isinstance(mlp, torch.nn.Module):
                raise ConfigError(f"train checkpoint_scope: mlp, but the decoder layers of {cfg.model} "
                                  f"({type(layer).__name__}) have no `mlp` block; use checkpoint_scope: layer")
            mlp.forward = functools.partial(_checkpointed_forward, mlp)  # type: ignore[method-assign]
            counts["mlp"] += 1
        if cfg.offload_activations and not whole:
            layer.forward = functools.partial(  # type: ignore[method-assign]
                _offloaded_forward, layer, device.type == "cuda")
            counts["offload"] += 1
    return counts
