"""The precision vLLM serves in: infer `dtype: auto` resolves to the trainer's weight dtype (`trainer_dtype`), and a
float32 vLLM with LoRA on a GPU is refused before it starts (`check_lora_dtype`). Used by `tidal grpo`'s derivation
(`tidal.colocate.derive.couple_precision`) and by the servers `tidal grpo-infer` starts (vLLM, SGLang). Torch-free.
"""

from __future__ import annotations

from tidal.config.infer import InferConfig
from tidal.config.load import ConfigError

FP32_LORA_REFUSED = ("vLLM's CUDA LoRA kernels take float16/bfloat16 weights only (vLLM 0.24 on an H100 died at start, "
                     "in its LoRA warm-up, with float32 and LoRA enabled)")


def check_lora_dtype(infer: InferConfig, on_gpu: bool) -> None:
    """A float32 vLLM with LoRA enabled on a GPU cannot start: refuse it before anything starts."""
    if on_gpu and infer.dtype == "float32" and infer.enable_lora:
        raise ConfigError(f"infer dtype float32 with enable_lora on a GPU: {FP32_LORA_REFUSED}; set infer dtype: "
                          f"auto (the trainer's precision: bfloat16 on a GPU) or bfloat16, or serve merged weights "
                          f"without LoRA (orch weight_broadcast.reload: merged and infer enable_lora: false)")


def trainer_dtype(recipe: str, device: str) -> str:
    """The dtype of the trainer's weights for train `recipe` on `device` (`tidal.trainer.model.load.resolve_dtype`):
    float32 on CPU or with `recipe: fp32`, else bfloat16. Infer `dtype: auto` resolves to it (in `tidal grpo-infer`
    alone, for the default `recipe: auto`), never to vLLM's own `auto`, which serves a float32 model in 16 bits."""
    return "float32" if device == "cpu" or recipe == "fp32" else "bfloat16"
