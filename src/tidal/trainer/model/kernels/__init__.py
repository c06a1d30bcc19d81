"""Fused kernels of the trainer, each switchable (train.yaml) and equal to the unfused computation by test.

`liger.py`: Liger Kernel's fused RMSNorm / SwiGLU / RoPE (train `liger_kernel`, CUDA, liger-kernel installed).
Here: `compile_layers` (train `compile_layers`) compiles every decoder layer in place with `torch.compile`
(`nn.Module.compile`), after PEFT added the LoRA adapters so they are inside the graph: inductor fuses the
elementwise work around the matmuls (RMSNorm, SwiGLU, RoPE, LoRA scaling and adds) into a few kernels, once per
input shape (the first steps are slower while it compiles). Gradient checkpointing wraps the compiled layer (the
checkpoint lives in `GradientCheckpointingLayer.__call__`, outside `forward`). It pays on CUDA with
`attention: flex` (the per-sample kernel's Python loop breaks the graph at every layer). Tests:
tests/unit/test_activations.py (CPU inductor, `slow`; CUDA, `gpu`).

Graphs (issue 43): the layers of one class share their graphs (dynamo lifts the parameters to inputs), and a
second row length recompiles once with the length dynamic (dynamo's automatic dynamic shapes), after which no
length compiles anything: at most `GRAPHS_PER_CLASS` per decoder-layer class (static then dynamic, with and
without autograd), counted by `compiled_graphs` (the trainer logs it as `layer_graphs`) and checked on CPU with
dense SDPA (tests/unit/test_activations.py). tidal's per-sample kernel loops over the samples of a row, which
breaks the graph per layout: there the count grows with every new packing (a reason `compile_layers` pays on CUDA
with flex only).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tidal.trainer.model.activations import decoder_layers

log = logging.getLogger(__name__)


GRAPHS_PER_CLASS = 4
"""Compiled graphs a decoder-layer class may make (module doc): static and dynamic length, with and without
autograd."""
_GRAPHS = [0]


def compiled_graphs() -> int:
    """Graphs compiled so far in this process for the decoder layers (`compile_layers`)."""
    return _GRAPHS[0]


def _counting(inner: str) -> Any:
    """A dynamo backend that counts its graphs (`compiled_graphs`) and hands them to `inner`."""
    from torch._dynamo.backends.registry import lookup_backend

    compile_graph = lookup_backend(inner)

    def backend(gm: Any, example_inputs: Any) -> Any:
        _GRAPHS[0] += 1
        log.info("compile_layers: compiled graph %d", _GRAPHS[0])
        return compile_graph(gm, example_inputs)

    return backend


def compile_layers(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Compile every decoder layer of `model` in place (train `compile_layers`), counting the graphs with
    `compiled_graphs`; `backend`: dynamo's backend (inductor; tests take `eager` to count graphs cheaply).
    Returns how many layers."""
    layers = decoder_layers(model)
    counted = _counting(backend)
    for layer in layers:
        layer.compile(backend=counted)
    return len(layers)
