"""Activation memory of the decoder layers: which layers gradient checkpointing recomputes, what it recomputes, and
where the kept activations live (train `gradient_checkpointing`, `checkpoint_every`, `checkpoint_scope`,
`offload_activations`). (`compile_layers` is `tidal.trainer.model.kernels`.) Every checkpointed function runs its
recompute (its second run, in the backward) inside a `tidal::recompute` profiler range (`tidal.trainer.profile`).

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
- `checkpoint_scope: elementwise` (selective activation checkpointing, as torchtitan's "op" policy): the whole
  layer runs under a non-reentrant checkpoint with torch's `create_selective_checkpoint_contexts` and a policy
  (`SAVED_OPS`) that keeps the outputs of its matmuls (base and LoRA) and of the attention kernel; only the cheap
  ops between them (RMSNorm, RoPE, SwiGLU's activation and product, LoRA scaling, residual adds, casts) run again
  in the backward. A `torch.compile`d attention (flex on CUDA) runs inductor's code, which a dispatch-mode policy
  never sees op by op: compiled with `keepable_inductor`, the region is one `higher_order.inductor_compiled_code`
  op to the policy, which keeps its outputs (tests/unit/test_activations_compiled.py counts it running once per
  layer and micro-batch on CPU; without it the region runs again in the backward). Less memory than none (those
  ops' saved inputs and outputs, e.g. the norms' float32 upcasts and the MLP's activation), far less recompute
  than `layer` (no matmul nor attention runs twice).
- `offload_activations`: the layers not checkpointed at layer level run under
  `torch.autograd.graph.save_on_cpu(pin_memory=...)`: what they save for the backward is copied to (pinned) host
  memory and back when the backward needs it. It trades PCIe traffic for device memory; with a layer-level
  checkpoint a layer saves only its input, so offloading there is refused by the config.

Gradients are those of no checkpointing (tests/unit/test_activations.py checks them in float64 on CPU).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from tidal.config.load import ConfigError
from tidal.trainer.profile import RECOMPUTE

SAVED_OPS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm",
             "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
             "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
             "aten._flash_attention_forward", "aten._efficient_attention_forward", "higher_order.flex_attention",
             "higher_order.inductor_compiled_code")
"""Ops whose outputs `checkpoint_scope: elementwise` keeps (the matmuls and the attention kernels, and the regions
compiled by `keepable_inductor`: the compiled attention); every other op of a checkpointed layer is recomputed in
the backward."""

_WRAP = "wrap_inductor_compiled_regions"


def keepable_inductor(gm: Any, example_inputs: Any) -> Any:
    """A dynamo backend: inductor, its compiled region wrapped as one `higher_order.inductor_compiled_code` op that
    dispatch modes see (inductor config `wrap_inductor_compiled_regions`), so that the `elementwise` policy keeps
    its outputs instead of running it again in the backward. For a kernel compiled on its own inside a checkpointed
    layer (flex attention on CUDA); a torch without that switch compiles as before (and recomputes it)."""
    import torch._inductor.config as inductor
    from torch._inductor.compile_fx import compile_fx

    patches = {_WRAP: True} if hasattr(inductor, _WRAP) else None
    return compile_fx(gm, example_inputs, config_patches=patches)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: transformers' checkpointable layers, in order (vision towers' excluded when
    the model has a language model)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers: list[tuple[str, torch.nn.Module]] = [
        (n, m) for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]
    text = [m for n, m in layers if "vision" not in n and "visual" not in n]
    return text or [m for _, m in layers]


@contextlib.contextmanager
def _recompute_range(inner: Any = None) -> Iterator[None]:
    """A checkpoint's recompute context: the `RECOMPUTE` profiler range, entered before `inner` (the selective
    policy's dispatch mode, which must not see the range's own op)."""
    with torch.profiler.record_function(RECOMPUTE), inner if inner is not None else contextlib.nullcontext():
        yield


def _contexts(selective: bool) -> tuple[Any, Any]:
    """`context_fn` of torch's checkpoint: (forward context, recompute context)."""
    if not selective:
        return contextlib.nullcontext(), _recompute_range()
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    forward, recompute = create_selective_checkpoint_contexts(_keep_matmuls)
    return forward, _recompute_range(recompute)


def _saved_op_list() -> list[Any]:
    """`SAVED_OPS` as the op overload packets this torch has (the attention kernels differ by version)."""
    ops = []
    for name in SAVED_OPS:
        space, _, op = name.partition(".")
        packet = getattr(getattr(torch.ops, space), op, None)
        if packet is not None:
            ops.append(packet)
    return ops


def _keep_matmuls(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> Any:
    """The `elementwise` policy: keep the outputs of `SAVED_OPS`, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_SAVE if packet in _SAVED.setdefault("ops", _saved_op_list()) else (
        CheckpointPolicy.PREFER_RECOMPUTE)


_SAVED: dict[str, list[Any]] = {}


def checkpoint(fn: Any, *args: Any, selective: bool = False, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` under torch's non-reentrant checkpoint, its recompute in the `RECOMPUTE` range;
    `selective`: keeping the outputs of `SAVED_OPS` (`checkpoint_scope: elementwise`)."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    if torch.compiler.is_compiling() and not selective:  # inside a compiled layer (`compile_layers` with `mlp`)
        # dynamo takes no context_fn but a selective policy's (its partitioner does the recompute; no range there)
        return torch_checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return torch_checkpoint(fn, *args, use_reentrant=False, context_fn=functools.partial(_contexts, selective),
                            **kwargs)


def _checkpointed_forward(module: torch.nn.Module, forward: Any, *args: Any, **kwargs: Any) -> Any:
    """`forward` (`module`'s forward before this wrapper: its class's, or one bound in its place, e.g. Liger's SwiGLU
    by `tidal.trainer.model.kernels.liger`) under a non-reentrant checkpoint when training with gradients."""
    if module.training and torch.is_grad_enabled():
        return checkpoint(forward, *args, **kwargs)
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
    counts = {"layer": 0, "elementwise": 0, "mlp": 0, "offload": 0}
    for i, layer in enumerate(layers):
        selected = cfg.gradient_checkpointing and i % cfg.checkpoint_every == 0
        whole = selected and cfg.checkpoint_scope in ("layer", "elementwise")
        if cfg.gradient_checkpointing:
            layer.gradient_checkpointing = whole  # type: ignore[assignment]  # transformers' per-layer switch
        if whole:  # transformers calls it with the layer's forward: ours labels the recompute (and keeps matmuls)
            layer._gradient_checkpointing_func = functools.partial(  # type: ignore[assignment]
                checkpoint, selective=cfg.checkpoint_scope == "elementwise")
        counts["layer" if cfg.checkpoint_scope != "elementwise" else "elementwise"] += whole
        if selected and cfg.checkpoint_scope == "mlp":
            mlp = getattr(layer, "mlp", None)
            if not isinstance(mlp, torch.nn.Module):
                raise ConfigError(f"train checkpoint_scope: mlp, but the decoder layers of {cfg.model} "
                                  f"({type(layer).__name__}) have no `mlp` block; use checkpoint_scope: layer")
            mlp.forward = functools.partial(_checkpointed_forward, mlp, mlp.forward)  # type: ignore[method-assign]
            counts["mlp"] += 1
        if cfg.offload_activations and not whole:
            layer.forward = functools.partial(  # type: ignore[method-assign]
                _offloaded_forward, layer, device.type == "cuda")
            counts["offload"] += 1
    return counts
