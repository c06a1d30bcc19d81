"""The precision vLLM serves in: infer `dtype: auto` resolves to the trainer's weight dtype (`trainer_dtype`), and a
float32 vLLM with LoRA on a GPU is refused before it starts (`check_lora_dtype`). Used by `tidal grpo`'s derivation
(`couple_precision`, `served_tolerance`, from `tidal.colocate.derive.precision`) and by the servers `tidal grpo-infer`
starts (vLLM, SGLang). Torch-free.
"""

from __future__ import annotations

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


def trainer_dtype(recipe: str, device: str) -> str:
    """The dtype of the trainer's weights for train `recipe` on `device` (`tidal.trainer.model.load.resolve_dtype`):
    float32 on CPU or with `recipe: fp32`, else bfloat16. Infer `dtype: auto` resolves to it (in `tidal grpo-infer`
    alone, for the default `recipe: auto`), never to vLLM's own `auto`, which serves a float32 model in 16 bits."""
    return "float32" if device == "cpu" or recipe == "fp32" else "bfloat16"


def couple_precision(train: TrainConfig, infer: InferConfig, device: str) -> tuple[InferConfig, str | None]:
    """One precision for the run: infer `dtype: auto` becomes the trainer's weight dtype (bfloat16 on a GPU unless
    train `recipe: fp32`; float32 on CPU, as `tidal.trainer.model.load.resolve_dtype`), so vLLM samples the policy the
    trainer scores. An explicit dtype is kept, with a notice when it differs from the trainer's (measured on an
    H100: a float32 vLLM beside a bf16 trainer gave mismatch_kl 2e-3 to 9e-3 per step, against <= 1e-3 wanted);
    float32 with LoRA on a GPU is refused (`check_lora_dtype`). Returns (infer, notice or None)."""
    trainer = trainer_dtype(train.recipe, device)
    if infer.dtype == "auto":
        infer = infer.model_copy(update={"dtype": trainer})
    check_lora_dtype(infer, device == "cuda")
    if infer.dtype != trainer:
        return infer, (f"vLLM serves in {infer.dtype} (infer dtype) while the trainer trains in {trainer}: their "
                       f"logprobs differ by the rounding (mismatch_kl); infer dtype: auto follows the trainer")
    return infer, None


def served_tolerance(train: TrainConfig, infer: InferConfig, device: str,
                     set_tolerance: float | None) -> tuple[float | None, str]:
    """The policy identity check's tolerance where the served dtype is coarser than the trainer's weights (a 16-bit
    vLLM beside float32 weights: an explicit infer `dtype`): its policy differs from the trainer's by 16-bit rounding,
    which the trainer's float32 tolerance would call a wrong policy (`tidal.transport.probe.TOLERANCE`). (None, "")
    where the trainer's own tolerance holds or orch `weight_broadcast.policy_check_tolerance` is set; else (the
    served dtype's tolerance, the notice saying so)."""
    served, trained = infer.dtype, trainer_dtype(train.recipe, device)
    if set_tolerance is not None or served not in TOLERANCE or TOLERANCE[served] <= TOLERANCE.get(trained, 0.0):
        return None, ""
    tol = TOLERANCE[served]
    return tol, (f"vLLM serves in {served}: orch weight_broadcast.policy_check_tolerance {tol:g} ({served}'s "
                 f"rounding), not the trainer's {trained} {TOLERANCE.get(trained, 0.0):g}")
