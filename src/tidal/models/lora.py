"""Which modules of a model LoRA adapts: train `lora_target_modules` resolved against the loaded model.

`all-linear` (as in PEFT) means every `nn.Linear` of the decoder, under its leaf name, except the output
layer: `q_proj ... down_proj` for Llama-likes, `qkv_proj, o_proj, gate_up_proj, down_proj` for Phi-3's fused
projections. The experts of a mixture-of-experts model are not `nn.Linear` in transformers 5 (one fused 3-d
parameter per layer), so on Qwen3-MoE `all-linear` adapts the attention projections (the router and the
experts stay as loaded). A named target must match at least one linear module's leaf name; otherwise the
error names the model's linear modules. The resolved list is what PEFT gets, so the adapter's
`target_modules` are explicit names vLLM's LoRA loader checks.

The inference server builds LoRA layers for the same list (`served_targets`, vLLM's `--lora-target-modules`,
SGLang's too): never for the embeddings or the LM head, which tidal does not train. Without the list vLLM 0.24
wraps every module it supports, the LM head included, and on a tied model its dummy-LoRA warm-up sizes the head's
dummy from the embedding (hidden x rank where vocabulary x rank is wanted): the bundled model (hidden 256 >
vocabulary 128) died at start on an H100/H200 (issue 33). vLLM maps the PEFT names onto its fused layers itself
(`q_proj` selects `qkv_proj`, `gate_proj` selects `gate_up_proj`).
"""

from __future__ import annotations

from typing import Any

from tidal.config.load import ConfigError

ALL_LINEAR = "all-linear"
VISION_MODULES = ("vision_model", "vision_tower", "visual", "connector", "multi_modal_projector", "embed_vision",
                  "audio_tower", "embed_audio")
"""Submodule names of the vision (and audio) tower / projector of transformers' VLMs: no LoRA there (the trainer
excludes them), and their linear modules' leaf names are not the language model's (Qwen2.5-VL's merger is an
`nn.Sequential` whose leaves are named `0` and `2`: as a PEFT target, `0` would select decoder layer 0; SigLIP's
attention has `q_proj` / `k_proj` too; Gemma 4's tower wraps them in a clipping module PEFT cannot adapt)."""


def excluded_modules(model: Any) -> str | None:
    """PEFT `exclude_modules` for `model`: a VLM's (its config has a `vision_config`) towers and projectors
    (`VISION_MODULES`), so LoRA adapts its language model only; None for a text model."""
    if getattr(getattr(model, "config", None), "vision_config", None) is None:
        return None
    return rf".*\.({'|'.join(VISION_MODULES)})\..*"


def linear_module_names(model: Any) -> list[str]:
    """Sorted leaf names of the model's `nn.Linear` modules, the output layer (lm_head) and a vision-language
    model's vision tower and projector (`VISION_MODULES`) excepted."""
    import torch

    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if isinstance(module, torch.nn.Linear) and module is not output
             and not set(name.split(".")) & set(VISION_MODULES)}
    return sorted(names)


def resolve_lora_targets(model: Any, targets: str | list[str], architecture: str = "") -> list[str]:
    """train `lora_target_modules` -> the leaf names PEFT adapts on `model`. Raises `ConfigError` (exit 2) for a
    name that matches no linear module, listing the ones there are."""
    linear = linear_module_names(model)
    if targets == ALL_LINEAR:
        if not linear:
            raise ConfigError(f"train lora_target_modules: all-linear: {architecture or 'the model'} has no "
                              "linear modules besides its output layer")
        return linear
    if isinstance(targets, str):
        targets = [targets]
    missing = [t for t in targets if t not in linear]
    if missing:
        what = architecture or type(model).__name__
        raise ConfigError(f"train lora_target_modules: {', '.join(missing)} matches no linear module of {what}; "
                          f"its linear modules are: {', '.join(linear)} (or use lora_target_modules: all-linear)")
    return list(targets)


def meta_model(model_dir: str, trust_remote_code: bool = False) -> tuple[Any, str]:
    """(the transformers model built from `model_dir`'s config on the meta device, its architecture name): no
    weights are read, nothing is allocated."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    # a vision-language model is built as the trainer builds it (`tidal.trainer.model.load.auto_model_class`)
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config, trust_remote_code=trust_remote_code)
    return model, (getattr(config, "architectures", None) or [type(model).__name__])[0]


DECODER_LINEAR = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
LINEAR_BY_MODEL_TYPE: dict[str, tuple[str, ...]] = {
    **{t: DECODER_LINEAR for t in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2",
                                            "granite")},
    "phi3": ("down_proj", "gate_up_proj", "o_proj", "qkv_proj"),
}
"""`linear_module_names` of the dense text models whose config.json `model_type` says it all (checked against the
meta model for every architecture of the test matrix: tests/unit/test_lora_targets_argv.py), so that `tidal
grpo-infer` names vLLM's LoRA targets without importing torch and transformers (seconds of its start-up on a small
CPU machine); any other model (mixture of experts, vision-language, remote code) is built on the meta device."""


def linear_names_from_config(model_dir: str) -> tuple[str, ...] | None:
    """`LINEAR_BY_MODEL_TYPE` for `model_dir`'s config.json, None where the table does not decide."""
    from tidal.models.config import read_config

    try:
        config = read_config(model_dir)
    except (OSError, ValueError):
        return None
    if config.get("text_config") or config.get("auto_map"):
        return None
    return LINEAR_BY_MODEL_TYPE.get(str(config.get("model_type")))


def served_targets(model_dir: str, targets: str | list[str], trust_remote_code: bool = False) -> list[str]:
    """The leaf names the trainer's LoRA adapts (`resolve_lora_targets` on the meta model of `model_dir`, or
    `LINEAR_BY_MODEL_TYPE` where it decides), for the inference server's LoRA layers (vLLM `--lora-target-modules`,
    SGLang's likewise). Raises `ConfigError` for a name that matches no linear module."""
    known = None if trust_remote_code else linear_names_from_config(model_dir)
    wanted = [targets] if isinstance(targets, str) and targets != ALL_LINEAR else targets
    if known is not None and (wanted == ALL_LINEAR or set(wanted) <= set(known)):
        return list(known) if wanted == ALL_LINEAR else list(wanted)
    model, arch = meta_model(model_dir, trust_remote_code)
    return resolve_lora_targets(model, targets, arch)


def check_targets(model_dir: str, targets: str | list[str], trust_remote_code: bool = False) -> None:
    """Resolve named `targets` on the model built from `model_dir`'s config on the meta device (no weights are
    read, nothing is allocated), so `tidal grpo` refuses a wrong name before anything starts."""
    if targets == ALL_LINEAR:
        return
    served_targets(model_dir, targets, trust_remote_code)
