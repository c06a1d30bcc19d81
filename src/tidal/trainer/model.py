"""Load the policy: a transformers causal LM from a local directory, wrapped with PEFT LoRA adapters.

Precision: float32 on CPU (matches vLLM CPU serving the bundled float32 model, so trainer and inference
logprobs agree); bfloat16 on CUDA. Attention uses SDPA; packed rows rely on transformers building a
block-diagonal causal mask from restarting `position_ids` (checked by tests/unit/test_packing.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from tidal.config.train import TrainConfig

log = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    """train `device`: `auto` -> cuda when available, else cpu; `cuda` without a GPU is an error."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is 'cuda' but no CUDA device is available (use 'auto' or 'cpu')")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(recipe: str, device: torch.device) -> torch.dtype:
    """float32 on CPU or with `recipe: fp32`; bfloat16 otherwise (fp8/nvfp4 recipes fall back, warned)."""
    if device.type == "cpu" or recipe == "fp32":
        return torch.float32
    if recipe not in ("bf16",):
        log.warning("recipe %s is not implemented yet; training in bfloat16", recipe)
    return torch.bfloat16


def check_model_dir(path: str) -> Path:
    """The model directory (`tidal:NAME` for a bundled one) must hold a config.json; nothing is downloaded."""
    from tidal.assets import resolve_model

    p = Path(resolve_model(path))
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"model '{path}': no config.json there; give the path of a local Hugging Face model directory "
            "(tidal never downloads models)")
    return p


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(check_model_dir(path)))


def load_base_model(path: str, device: torch.device, dtype: torch.dtype) -> Any:
    """The plain causal LM in `dtype` on `device`, SDPA attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(check_model_dir(path)), dtype=dtype,
                                                 attn_implementation="sdpa")
    return model.to(device)  # type: ignore[arg-type]


def add_lora(model: torch.nn.Module, cfg: TrainConfig) -> torch.nn.Module:
    """Wrap `model` with trainable LoRA adapters (B initialized to zero: step 0 equals the base model)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=list(cfg.lora_target_modules), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Activation checkpointing of every decoder layer through transformers' own (non-reentrant) hook, before
    PEFT wraps the model; inputs are made to require grad (`enable_input_require_grads`) so frozen embeddings
    under LoRA still pass gradients into the checkpointed layers."""
    model.gradient_checkpointing_enable(  # type: ignore[operator]
        gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()  # type: ignore[operator]


def apply_cpu_affinity(cores: list[int] | None) -> None:
    """Pin this process to `cores` and use one torch thread per core (no-op for None)."""
    if not cores:
        return
    import os

    try:
        os.sched_setaffinity(0, set(cores))
    except (AttributeError, OSError) as exc:
        raise RuntimeError(f"train.cpu_affinity {cores}: cannot pin to these cores ({exc})") from None
    torch.set_num_threads(len(cores))


def load_policy(cfg: TrainConfig) -> tuple[torch.nn.Module, torch.device]:
    """Model to train per `cfg` (LoRA-wrapped when `cfg.lora`, activation checkpointing with
    `cfg.gradient_checkpointing`), and its device."""
    apply_cpu_affinity(cfg.cpu_affinity)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    model = load_base_model(cfg.model, device, resolve_dtype(cfg.recipe, device))
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if cfg.lora:
        model = add_lora(model, cfg)
    model.train()
    return model, device
