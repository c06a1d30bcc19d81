"""Fused kernels of the trainer, each switchable (train.yaml) and equal to the unfused computation by test.

Today one: `compile_layers` (train `compile_layers`) compiles every decoder layer in place with `torch.compile`
(`nn.Module.compile`), after PEFT added the LoRA adapters so they are inside the graph: inductor fuses the
elementwise work around the matmuls (RMSNorm, SwiGLU, RoPE, LoRA scaling and adds) into a few kernels, once per
input shape (the first steps are slower while it compiles). Gradient checkpointing wraps the compiled layer (the
checkpoint lives in `GradientCheckpointingLayer.__call__`, outside `forward`). It pays on CUDA with
`attention: flex` (the per-sample kernel's Python loop breaks the graph at every layer). Liger-Kernel's Triton
kernels (RMSNorm, SwiGLU, RoPE, fused linear + log-probability) would be the next candidates; they need CUDA and
are not a dependency of tidal. Tests: tests/unit/test_activations.py (CPU inductor, `slow`; CUDA, `gpu`).
"""

from __future__ import annotations

import torch

from tidal.trainer.model.activations import decoder_layers


def compile_layers(model: torch.nn.Module) -> int:
    """Compile every decoder layer of `model` in place (train `compile_layers`); returns how many."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile()
    return len(layers)
