"""Load the policy: a transformers causal LM from a local directory, wrapped with PEFT LoRA adapters.

Precision: float32 weights on CPU (train `recipe: bf16`, the default where the CPU has bfloat16 units, autocasts the
matmuls: `tidal.trainer.model.precision`); bfloat16 on CUDA. Attention: train `attention`
(`tidal.trainer.model.attention`: flex_attention with the packed layout's block mask on CUDA, per-sample SDPA on CPU);
packed rows are read from restarting `position_ids` (checked by tests/unit/test_packing.py). Activation memory
(selective checkpointing, offload) and compiled layers: `tidal.trainer.model.activations`. Liger Kernel's fused
RMSNorm / SwiGLU / RoPE (train `liger_kernel`, CUDA): `tidal.trainer.model.kernels.liger`. The model is built the way
vLLM serves it: train `trust_remote_code` reaches the model's and the tokenizer's `from_pretrained`, and train
`rope_scaling` is applied onto the Hugging Face config before the model is built (`tidal grpo` makes both follow
infer.yaml). Device: train `device` (`cuda:N` picks one of the visible GPUs). QLoRA (`qlora_bnb`, `qlora_fp8`): the
base's linear layers are quantized while loading (`tidal.trainer.model.quant`). Shared base weights (train
`share_base_weights` resolved on by `tidal grpo`): the frozen base is built from the co-located vLLM's own tensors
instead (`tidal.trainer.model.shared_base`). A vision-language model (its config has a `vision_config`) is built with
`AutoModelForImageTextToText`, only for the families whose image inputs the trainer builds
(`tidal.trainer.model.vision.TRAINABLE`; others are refused), and gets LoRA on its language model only
(`VISION_MODULES` excluded).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from tidal.config.load import ConfigError
from tidal.config.train import BASE_MODEL_KEYS, TrainConfig, base_model_key
from tidal.models.families import has_linear_attention
from tidal.trainer.model.activations import apply_activation_policy
from tidal.trainer.model.hf import (
    attn_implementation,
    auto_model_class,
    check_model_dir,
    load_model_config,
)
from tidal.trainer.model.kernels import compile_layers
from tidal.trainer.model.precision import apply_recipe
from tidal.trainer.model.quant import QuantKind, base_report, qlora_kind, quantization_config, quantize_on_load
from tidal.trainer.model.vision import is_vision_config

log = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    """train `device` -> the torch device: `auto` -> cuda when available, else cpu; `cuda` / `cuda:N` without a
    GPU, or a GPU index past those this process sees, raises `ConfigError` naming the key (exit 2)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"train device is '{device}' but no CUDA device is available here (use 'auto' or 'cpu')")
    dev = torch.device(device)
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
        raise ConfigError(f"train device is '{device}' but this process sees {count} GPU(s){shown}: valid are "
                          f"cuda:0 to cuda:{count - 1}; GPU indices count the visible GPUs only")
    return dev


def resolve_dtype(recipe: str, device: torch.device) -> torch.dtype:
    """The weights' dtype: float32 on CPU (`recipe: bf16` there autocasts the matmuls: `tidal.trainer.model.precision`)
    or with `recipe: fp32`; bfloat16 otherwise (`fp8-hybrid` keeps bf16 weights and runs the linear layers'
    matmuls in FP8)."""
    if device.type == "cpu" or recipe == "fp32":
        return torch.float32
    return torch.bfloat16


def load_tokenizer(path: str, trust_remote_code: bool = False, chat_template: str | None = None) -> Any:
    """The model directory's tokenizer (`trust_remote_code`: train `trust_remote_code`, for custom tokenizer code),
    with train `chat_template` (a file or an inline template; null: the model's own) as its chat template: what
    `tidal sft` renders conversational prompts with and the exports carry, the template vLLM serves (infer
    `chat_template`, which `tidal grpo` keeps equal)."""
    from transformers import AutoTokenizer

    from tidal.config.chat_template import template_text

    tok = AutoTokenizer.from_pretrained(str(check_model_dir(path)), trust_remote_code=trust_remote_code)
    if chat_template is not None:
        tok.chat_template = template_text(chat_template)
    return tok


def load_base_model(path: str, device: torch.device, dtype: torch.dtype, *, trust_remote_code: bool = False,
                    rope_scaling: dict[str, Any] | None = None, quantized: QuantKind | None = None,
                    attention: str = "auto") -> Any:
    """The plain causal LM in `dtype` on `device`, with train `attention`'s kernel (`attn_implementation`: flex on
    CUDA, per packed sample on CPU); `trust_remote_code` and `rope_scaling` as in train.yaml (the config is loaded and
    changed first, then the model is built from it); `quantized`: its linear layers stored in NF4 or FP8 (QLoRA,
    `tidal.trainer.model.quant`)."""
    config = load_model_config(path, trust_remote_code, rope_scaling)
    extra: dict[str, Any] = {}
    if quantized is not None:  # quantized while loading, straight onto the device
        extra = {"quantization_config": quantization_config(quantized, dtype), "device_map": {"": device}}
    model = auto_model_class(config, path).from_pretrained(str(check_model_dir(path)), config=config, dtype=dtype,
                                                           attn_implementation=attn_implementation(
                                                               device, attention, is_vision_config(config),
                                                               has_linear_attention(config)),
                                                           trust_remote_code=trust_remote_code, **extra)
    if quantized is not None:
        quantize_on_load(model)
        return model
    return model.to(device)  # type: ignore[arg-type]


def add_lora(model: torch.nn.Module, cfg: TrainConfig) -> torch.nn.Module:
    """Wrap `model` with trainable LoRA adapters (B initialized to zero: step 0 equals the base model) on the
    modules train `lora_target_modules` names (`all-linear`, or names checked against the model's linear
    modules: `tidal.models.lora`)."""
    from peft import LoraConfig, get_peft_model

    from tidal.models.lora import excluded_modules, resolve_lora_targets

    arch = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
    targets = resolve_lora_targets(model, cfg.lora_target_modules, arch)
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets, bias="none", task_type="CAUSAL_LM",
                      exclude_modules=excluded_modules(model))  # VLM: the language model only
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
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # so per-device calls (peak memory, RNG states) mean this GPU
    kind = qlora_kind(cfg)
    model = take_kept(cfg)
    if model is None:
        model = load_base(cfg, device)
    if kind is not None:
        r = base_report(model, kind)
        log.info("QLoRA base (%s): %d linear layers, %.1f M parameters in %.2f MiB (%.3f bytes/parameter, scales "
                 "included)", kind.upper(), r["layers"], r["params"] / 1e6, r["bytes"] / 2**20, r["bytes_per_param"])
    return prepare_policy(model, cfg, device), device


def load_base(cfg: TrainConfig, device: torch.device) -> torch.nn.Module:
    """The frozen base model train `cfg` trains on `device` (what `BASE_MODEL_KEYS` decide, nothing else): vLLM's own
    tensors with `share_base_weights` (`tidal.trainer.model.shared_base`), else the checkpoint (`load_base_model`)."""
    if cfg.share_base_weights is True:
        from tidal.trainer.model.shared_base import load_shared_base

        return load_shared_base(cfg, device, resolve_dtype(cfg.recipe, device))
    return load_base_model(cfg.model, device, resolve_dtype(cfg.recipe, device),  # type: ignore[no-any-return]
                           trust_remote_code=cfg.trust_remote_code, rope_scaling=cfg.rope_scaling,
                           quantized=qlora_kind(cfg), attention=cfg.attention)


_kept: tuple[dict[str, Any], torch.nn.Module] | None = None
"""A base loaded ahead of the run (`keep_base`) and the `base_model_key` it was loaded for."""


def keep_base(model: torch.nn.Module, key: dict[str, Any]) -> None:
    """Make `model` (a `load_base` of a config whose `base_model_key` is `key`) the base the next `load_policy` of a
    config with the same key builds on instead of loading one: the warm pool's trainer process loads it once and
    forks a trainer per run (`tidal.colocate.warm_trainer`; each fork's writes stay its own)."""
    global _kept
    _kept = (dict(key), model)


def take_kept(cfg: TrainConfig) -> torch.nn.Module | None:
    """The kept base (`keep_base`), once, if it was loaded for `cfg`'s `base_model_key`; None when none is kept. A
    kept base of another key is a `ConfigError` naming the keys: never a run on a base loaded for other values."""
    global _kept
    if _kept is None:
        return None
    key, model = _kept
    want = base_model_key(cfg)
    if want != key:
        diff = "; ".join(f"train {k}: kept {key.get(k)!r}, this run {want.get(k)!r}" for k in BASE_MODEL_KEYS
                         if key.get(k) != want.get(k))
        raise ConfigError(f"the base model kept for this trainer was loaded for other train settings ({diff}); "
                          f"start the warm pool with this run's train config, or run without it")
    _kept = None
    log.info("base model %s: the one kept loaded by the warm pool's trainer (no load)", cfg.model)
    return model


def prepare_policy(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.nn.Module:
    """A loaded base `model` made the policy `cfg` trains: Liger's kernels (`liger_kernel`:
    `tidal.trainer.model.kernels.liger`), activation checkpointing (`auto` resolved:
    `tidal.trainer.memory.resolve_checkpointing`) and the activation policy (`tidal.trainer.model.activations`), the
    precision recipe, LoRA (or frozen embeddings), dropout off (`disable_dropout`), compiled layers; in train
    mode. (bench/gpu_trainer.py builds its random-init models through this too.)"""
    from tidal.trainer.memory import resolve_checkpointing

    cfg = cfg.model_copy(update={"gradient_checkpointing": resolve_checkpointing(cfg, device)})
    if cfg.liger_kernel:  # before the activation policy and PEFT: both call the patched forwards
        from tidal.trainer.model.kernels.liger import apply_liger

        log.info("liger_kernel: patched %s", apply_liger(model, cfg.liger_kernel, device))
    if cfg.gradient_checkpointing:  # `auto`: off on CPU; on CUDA when the estimate needs it
        enable_gradient_checkpointing(model)
    if cfg.gradient_checkpointing or cfg.offload_activations:
        log.info("activations: %s", apply_activation_policy(model, cfg, device))
    model = apply_recipe(model, cfg.recipe, device)  # fp8-hybrid: float8 base matmuls (trainer/model/precision.py)
    if cfg.lora:
        model = add_lora(model, cfg)
    elif cfg.freeze_embeddings:
        embeddings: Any = model.get_input_embeddings()  # type: ignore[operator]
        embeddings.weight.requires_grad_(False)  # a tied lm_head is the same tensor
    if cfg.disable_dropout:  # TRL's disable_dropout: every nn.Dropout, the adapters' included
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    if cfg.compile_layers:
        log.info("compile_layers: %d decoder layers compiled (torch.compile, on first use)", compile_layers(model))
    model.train()
    return model
