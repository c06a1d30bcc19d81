"""Liger Kernel's fused Triton kernels in the trainer's decoder layers (train `liger_kernel`: `rms_norm`, `swiglu`,
`rope`), from the maintained library (liger-kernel 0.8.5) rather than kernels of tidal's own.

What is patched, and when: `apply_liger` runs in `prepare_policy` on the loaded transformers model, before the
activation policy, the precision recipe and PEFT (`tidal.trainer.model.load`), on the instances, the way Liger's own
`apply_liger_kernel_to_qwen3(model=...)` patches an already built model:
- `rms_norm`: every module of the family's RMSNorm class (`FAMILIES`; Qwen3: the layers' input / post-attention
  norms, the attention's q_norm / k_norm and the final norm) gets `LigerRMSNorm.forward` bound, with Liger's llama
  casting mode (float32 statistics, cast back before the weight: the transformers computation) and its defaults;
- `swiglu`: every module of the family's MLP class gets `LigerSwiGLUMLP.forward` bound: `down_proj(silu(gate_proj(x))
  * up_proj(x))` with the silu and the product one Triton kernel. The module keeps its `gate_proj` / `up_proj` /
  `down_proj` Linear children and the forward calls them by attribute at run time, so PEFT's LoRA layers (added
  after) wrap and run as before, and quantized or FP8 linear layers too;
- `rope`: the family's `modeling_<type>.apply_rotary_pos_emb` (a module-level function the attention calls) becomes
  `liger_rotary_pos_emb`. That is process-wide for the family (every model of it built in this process), as in
  Liger; the trainer process holds one model.
Liger's class-level patches (replacing `modeling_qwen3.Qwen3RMSNorm` before a model is built) are not used: the
model is already built, and they would leak into any later model of the process.

Not used: Liger's fused linear cross-entropy (`fused_linear_cross_entropy`, the causal LM's `lce_forward`) returns a
mean loss over labels; tidal's step needs the per-token log-probability of each sampled token and the entropy
(`tidal.trainer.step.logprobs`, a chunked LM head), which that kernel does not give.

Refusals (`ConfigError`, exit 2, naming the key; `check_config` needs no torch and runs in the preflight):
architectures other than `FAMILIES` (vision-language models included), `swiglu` with an MLP activation other than
silu, a device without CUDA (Liger's kernels are Triton, CUDA only here), liger-kernel not installed.

Tests: tests/unit/test_liger.py (which modules each architecture patches, the refusals; on CUDA, `gpu`: logprobs and
LoRA gradients with and without it, bf16, tiny Qwen3 and Llama built from configs). Unmeasured on a GPU so far
(bench/GPU.md, `--options liger`).
"""

from __future__ import annotations

import importlib
import importlib.util
import types
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tidal.config.load import ConfigError

KEY = "train liger_kernel"
FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaRMSNorm", "LlamaMLP"),
    "mistral": ("MistralRMSNorm", "MistralMLP"),
    "qwen2": ("Qwen2RMSNorm", "Qwen2MLP"),
    "qwen3": ("Qwen3RMSNorm", "Qwen3MLP"),
}
"""transformers `model_type` -> (its RMSNorm class, its SwiGLU MLP class) in `modeling_<model_type>`: the text
families tidal patches (those Liger's `apply_liger_kernel_to_<type>` covers with these three kernels and tidal's tests
build)."""
INSTALL = ("pip install liger-kernel==0.8.5 (pure Python over Triton; on the GPU machines the kit's "
           ".gpu-kit/trl/liger_kernel-0.8.5-py3-none-any.whl, scripts/gpu_kit_trl.sh)")


def check_config(ops: Sequence[str], config: Mapping[str, Any], model: str) -> None:
    """Refuse `ops` for a model whose config.json dict is `config` (torch-free): a vision-language model or a family
    outside `FAMILIES`, and `swiglu` with an MLP activation other than silu."""
    if not ops:
        return
    kind = config.get("model_type")
    if "vision_config" in config or kind not in FAMILIES:
        raise ConfigError(f"{KEY} {list(ops)}: {model} is a {kind or 'unknown'} model; tidal applies Liger's kernels "
                          f"to the {', '.join(sorted(FAMILIES))} text models only (drop liger_kernel)")
    act = config.get("hidden_act", "silu")
    if "swiglu" in ops and act not in ("silu", "swish"):
        raise ConfigError(f"{KEY} swiglu: {model}'s MLP activation is {act}, Liger's SwiGLU kernel computes silu; "
                          f"drop swiglu from liger_kernel")


def check_runtime(ops: Sequence[str], device: torch.device | str) -> None:
    """Refuse `ops` on a device without CUDA, or where liger-kernel cannot be imported."""
    if not ops:
        return
    if torch.device(device).type != "cuda":
        raise ConfigError(f"{KEY} {list(ops)}: the trainer runs on {device}, and Liger's kernels are Triton/CUDA only; "
                          f"drop liger_kernel or train on a CUDA device")
    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError(f"{KEY} {list(ops)}: liger-kernel is not installed (it is not a tidal dependency): {INSTALL}")


def _modeling(kind: str) -> types.ModuleType:
    """transformers' `modeling_<kind>` module."""
    return importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")


def liger_targets(model: torch.nn.Module, ops: Sequence[str]) -> dict[str, list[str]]:
    """What `apply_liger` patches in `model` (a transformers model, before PEFT): per op, the qualified names of the
    modules (`rms_norm`: the family's RMSNorm instances; `swiglu`: its MLP instances) or, for `rope`, the modeling
    module whose `apply_rotary_pos_emb` is replaced. Refuses a model `check_config` refuses."""
    config: Any = model.config
    check_config(ops, config.to_dict(), getattr(config, "name_or_path", "") or type(model).__name__)
    modeling = _modeling(config.model_type)
    norm, mlp = (getattr(modeling, name) for name in FAMILIES[config.model_type])
    out: dict[str, list[str]] = {}
    if "rms_norm" in ops:
        out["rms_norm"] = [n for n, m in model.named_modules() if type(m) is norm]
    if "swiglu" in ops:
        out["swiglu"] = [n for n, m in model.named_modules() if type(m) is mlp]
    if "rope" in ops:
        out["rope"] = [modeling.__name__]
    return out


def apply_liger(model: torch.nn.Module, ops: Sequence[str], device: torch.device) -> dict[str, int]:
    """Patch `model`'s `liger_targets` with Liger's kernels (module doc); returns how many of each were patched.
    Refuses (exit 2) where `check_runtime` or `check_config` does."""
    check_runtime(ops, device)
    targets = liger_targets(model, ops)
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    for name in targets.get("rms_norm", []):
        norm: Any = model.get_submodule(name)
        # LigerRMSNorm's attributes with Liger's llama defaults (its _patch_rms_norm_module); the weight and
        # variance_epsilon are the module's own
        norm.offset, norm.casting_mode, norm.in_place, norm.row_mode = 0.0, "llama", True, None
        norm.forward = types.MethodType(LigerRMSNorm.forward, norm)
    for name in targets.get("swiglu", []):
        mlp: Any = model.get_submodule(name)
        mlp.forward = types.MethodType(LigerSwiGLUMLP.forward, mlp)
    for name in targets.get("rope", []):
        modeling: Any = importlib.import_module(name)
        modeling.apply_rotary_pos_emb = liger_rotary_pos_emb
    return {op: len(names) for op, names in targets.items()}
