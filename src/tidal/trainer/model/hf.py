"""What transformers builds for a model directory, before any weight is loaded: the directory check
(`check_model_dir`), its config with train `rope_scaling` applied (`load_model_config`, `apply_rope_scaling`), the
auto class (`auto_model_class`: a causal LM, or an image-text-to-text model for the VLMs the trainer builds) and the
attention implementation (`attn_implementation`). Used by `tidal.trainer.model.load` and by the shared base
(`tidal.trainer.model.shared_base`), which builds the model around vLLM's tensors instead of loading them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tidal.config.load import ConfigError
from tidal.models.families import TEXT_PATH_VLMS
from tidal.models.rope import merge_rope
from tidal.trainer.model.mrope import check_transformers
from tidal.trainer.model.vision import TRAINABLE, is_vision_config


def check_model_dir(path: str) -> Path:
    """The model directory (`tidal:NAME` for a bundled one) must hold a config.json; nothing is downloaded."""
    from tidal.models.files import is_model_dir
    from tidal.models.sources import resolve_model

    p = Path(resolve_model(path))
    if not is_model_dir(p):
        raise FileNotFoundError(
            f"model '{path}': no config.json there; give the path of a local Hugging Face model directory "
            "(tidal never downloads models)")
    return p


def apply_rope_scaling(config: Any, rope_scaling: dict[str, Any]) -> None:
    """Apply train `rope_scaling` onto a transformers `config` in place, before the model is built. It is merged
    over the config's RoPE parameters: keys it does not give keep the model's values (since transformers 5,
    `rope_theta` lives in the same dict, and a plain replacement would reset it to the class default). The
    legacy `type` key is read as `rope_type`. Per-layer-type RoPE (e.g. Gemma 3) takes `{layer_type: {...}}`.
    A vision-language model's language model reads its text config (`get_text_config()`, e.g. Qwen2.5-VL's
    `text_config`, with its `mrope_section`): the parameters are merged there, as vLLM gets them
    (`tidal.inference.backends.vllm.server`). Raises `ConfigError` naming the key for a dict transformers rejects."""
    get_text = getattr(config, "get_text_config", None)
    config = get_text() if callable(get_text) else config
    if not hasattr(config, "rope_parameters"):  # transformers < 5: rope_theta is a separate attribute
        config.rope_scaling = merge_rope(None, rope_scaling, "train rope_scaling")
        return
    merged = merge_rope(config.rope_parameters, rope_scaling, "train rope_scaling")
    per_type = bool(merged) and all(isinstance(v, dict) for v in merged.values())
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for params in merged.values() if per_type else [merged]:
        kind = params.get("rope_type", "default")
        if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
            raise ConfigError(f"train rope_scaling {rope_scaling}: unknown rope_type {kind!r} (valid: default, "
                              f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))})")
    config.rope_parameters = merged
    try:
        for step in ("standardize_rope_params", "validate_rope"):
            fn = getattr(config, step, None)
            if callable(fn):
                fn()
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"train rope_scaling {rope_scaling} is not valid for this model: {exc}") from None


def load_model_config(path: str, trust_remote_code: bool = False, rope_scaling: dict[str, Any] | None = None) -> Any:
    """The model directory's Hugging Face config, with `rope_scaling` applied (`apply_rope_scaling`)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(check_model_dir(path)), trust_remote_code=trust_remote_code)
    if rope_scaling:
        apply_rope_scaling(config, rope_scaling)
    return config


def auto_model_class(config: Any, path: str) -> Any:
    """`AutoModelForCausalLM`, or `AutoModelForImageTextToText` for a vision-language model whose image inputs the
    trainer builds (`tidal.trainer.model.vision.TRAINABLE`) or whose text path it trains (the checkpoint's own class,
    so its names stay the checkpoint's: `tidal.models.families.TEXT_PATH_VLMS`); another VLM raises `ConfigError`
    naming its architecture, a Qwen-VL under transformers older than its M-RoPE floor (`mrope.check_transformers`)
    too."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if not is_vision_config(config):
        return AutoModelForCausalLM
    archs = list(getattr(config, "architectures", None) or [type(config).__name__])
    if not set(archs) & set(TRAINABLE + TEXT_PATH_VLMS):
        raise ConfigError(f"train model '{path}' is a vision-language model ({', '.join(archs)}); tidal trains "
                          f"the VLM families {', '.join(TRAINABLE)} and the text path of "
                          f"{', '.join(TEXT_PATH_VLMS)} (see docs/vlm.md)")
    check_transformers(getattr(config, "model_type", ""))
    return AutoModelForImageTextToText


def attn_implementation(device: torch.device, kind: str = "auto", vision: bool = False, linear: bool = False) -> str:
    """The trainer's attention for train `attention` (`kind`) on `device` (`tidal.trainer.model.attention.choose`:
    `auto` is flex_attention on CUDA, per sample of a packed row on CPU); a kernel that cannot run here raises
    `ConfigError` naming the key."""
    from tidal.trainer.model.attention import implementation

    try:
        return implementation(kind, device, vision, linear)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
