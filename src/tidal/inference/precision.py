"""The run's precision: train `recipe: auto` made concrete (`resolve_recipe`: bf16 on a GPU; on CPU bf16 where the CPU
multiplies bfloat16 natively, else fp32), infer `dtype: auto` resolved to the trainer's matmul precision
(`matmul_dtype`; a server started alone: `trainer_dtype`), and a float32 vLLM with LoRA on a GPU refused before it
starts (`check_lora_dtype`). Used by `tidal grpo`'s derivation (`couple_precision`, `served_tolerance`, from
`tidal.colocate.derive.precision`), the trainer (`tidal.trainer.model.load.prepare_policy`) and the servers
`tidal grpo-infer` starts (vLLM, SGLang). Torch-free.
"""

from __future__ import annotations

import os
from pathlib import Path

from tidal.config.infer import InferConfig
from tidal.config.load import ConfigError
from tidal.config.train import TrainConfig
from tidal.transport.probe import TOLERANCE

FP32_LORA_REFUSED = ("vLLM's CUDA LoRA kernels take float16/bfloat16 weights only (vLLM 0.24 on an H100 died at start, "
                     "in its LoRA warm-up, with float32 and LoRA enabled)")


def check_lora_dtype(infer: InferConfig, on_gpu: bool) -> None:
    """A float32 vLLM with LoRA enabled on a GPU cannot start: refuse it before anything starts."""
    if on_gpu and infer.dtype == "float32" and infer.enable_lora:
        raise ConfigError(f"infer dtype float32 with enable_lora on a GPU: {FP32_LORA_REFUSED}; set infer dtype: "
                          f"auto (the trainer's precision: bfloat16 on a GPU) or bfloat16, or serve merged weights "
                          f"without LoRA (orch weight_broadcast.reload: merged and infer enable_lora: false)")


CPU_RECIPE_VAR = "TIDAL_CPU_RECIPE"
"""Environment variable: what train `recipe: auto` means on CPU (`fp32` or `bf16`) instead of this CPU's bfloat16
units deciding; the test suite sets `fp32`, so its results do not depend on the CPU it runs on."""


def has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX; read from /proc/cpuinfo on Linux)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_recipe(recipe: str, device: str) -> str:
    """Train `recipe` for a trainer on `device` (`cpu`, `cuda`): `auto` is `bf16` on a GPU and, on CPU, `bf16`
    where the CPU multiplies bfloat16 natively (`has_bf16_matmul`: float32 weights, bfloat16 matmuls, vLLM in
    bfloat16; bench/LEARN-68-1024-S83.md: greedy 0.737 +- 0.030 against float32's 0.741 +- 0.023 over 5 seeds, whole
    runs 135 s against 217 s), else `fp32` (emulated bfloat16 is slower than float32), unless `CPU_RECIPE_VAR` says
    which; any other recipe is itself."""
    if recipe != "auto":
        return recipe
    if device != "cpu":
        return "bf16"
    forced = os.environ.get(CPU_RECIPE_VAR)
    if forced:
        if forced not in ("fp32", "bf16"):
            raise ConfigError(f"{CPU_RECIPE_VAR}={forced!r}: what train recipe auto means on CPU must be fp32 or bf16")
        return forced
    return "bf16" if has_bf16_matmul() else "fp32"


def matmul_dtype(recipe: str, device: str) -> str:
    """The dtype the trainer's matmuls run in for a resolved train `recipe` (`resolve_recipe`) on `device`: bfloat16
    for `bf16` (on a GPU its weights, on CPU its autocast) and on a GPU for the FP8 recipes' weights, else float32.
    Infer `dtype: auto` follows it in `tidal grpo` (`couple_precision`)."""
    if recipe == "bf16" or (device != "cpu" and recipe != "fp32"):
        return "bfloat16"
    return "float32"


def trainer_dtype(recipe: str, device: str) -> str:
    """The dtype of the trainer's weights for train `recipe` on `device` (`tidal.trainer.model.load.resolve_dtype`):
    float32 on CPU or with `recipe: fp32`, else bfloat16. Infer `dtype: auto` resolves to it in a server started
    alone (`tidal grpo-infer`, `tidal eval`, the Tinker service: no trainer to follow, so float32 on CPU whatever the
    CPU), never to vLLM's own `auto`, which serves a float32 model in 16 bits."""
    return "float32" if device == "cpu" or recipe == "fp32" else "bfloat16"


def couple_precision(train: TrainConfig, infer: InferConfig, device: str) -> tuple[InferConfig, str | None]:
    """One precision for the run: infer `dtype: auto` becomes the trainer's matmul precision (`matmul_dtype` of the
    resolved recipe: bfloat16 on a GPU unless train `recipe: fp32`; on CPU bfloat16 for `recipe: bf16`, the default
    where the CPU has bfloat16 units, else float32), so vLLM samples the policy the trainer scores. An explicit
    dtype is kept, with a notice when it differs from the trainer's (measured on an H100: a float32 vLLM beside a
    bf16 trainer gave mismatch_kl 2e-3 to 9e-3 per step, against <= 1e-3 wanted); float32 with LoRA on a GPU is
    refused (`check_lora_dtype`). Returns (infer, notice or None)."""
    trainer = matmul_dtype(resolve_recipe(train.recipe, device), device)
    if infer.dtype == "auto":
        infer = infer.model_copy(update={"dtype": trainer})
    check_lora_dtype(infer, device == "cuda")
    if infer.dtype != trainer:
        return infer, (f"vLLM serves in {infer.dtype} (infer dtype) while the trainer trains in {trainer}: their "
                       f"logprobs differ by the rounding (mismatch_kl); infer dtype: auto follows the trainer")
    return infer, None


def served_tolerance(train: TrainConfig, infer: InferConfig, device: str,
                     set_tolerance: float | None) -> tuple[float | None, str]:
    """The policy identity check's tolerance where the served dtype is coarser than the trainer's matmuls (the probe
    record's dtype; a 16-bit vLLM beside a float32 trainer: an explicit infer `dtype`): its policy differs from the
    trainer's by 16-bit rounding,
    which the trainer's float32 tolerance would call a wrong policy (`tidal.transport.probe.TOLERANCE`). (None, "")
    where the trainer's own tolerance holds or orch `weight_broadcast.policy_check_tolerance` is set; else (the
    served dtype's tolerance, the notice saying so)."""
    served, trained = infer.dtype, matmul_dtype(resolve_recipe(train.recipe, device), device)
    if set_tolerance is not None or served not in TOLERANCE or TOLERANCE[served] <= TOLERANCE.get(trained, 0.0):
        return None, ""
    tol = TOLERANCE[served]
    return tol, (f"vLLM serves in {served}: orch weight_broadcast.policy_check_tolerance {tol:g} ({served}'s "
                 f"rounding), not the trainer's {trained} {TOLERANCE.get(trained, 0.0):g}")
