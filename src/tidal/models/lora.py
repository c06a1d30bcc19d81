"""Which modules of a model LoRA adapts: train `lora_target_modules` resolved against the loaded model.

`all-linear` (as in PEFT) means every `nn.Linear` of the decoder, under its leaf name, except the output
layer: `q_proj ... down_proj` for Llama-likes, `qkv_proj, o_proj, gate_up_proj, down_proj` for Phi-3's fused
projections. The experts of a mixture-of-experts model are not `nn.Linear` in transformers 5 (one fused 3-d
parameter per layer), so on Qwen3-MoE `all-linear` adapts the attention projections (the router and the
experts stay as loaded). A named target must match at least one linear module's leaf name; otherwise the
error names the model's linear modules. The resolved list is what PEFT gets, so the adapter's
`target_modules` are explicit names vLLM's LoRA loader checks.
"""

from __future__ import annotations

from typing import Any

from tidal.config.load import ConfigError

ALL_LINEAR = "all-linear"


def linear_module_names(model: Any) -> list[str]:
    """Sorted leaf names of the model's `nn.Linear` modules, the output layer (lm_head) excepted."""
    import torch

    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if isinstance(module, torch.nn.Linear) and module is not output}
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


def check_targets(model_dir: str, targets: str | list[str], trust_remote_code: bool = False) -> None:
    """Resolve named `targets` on the model built from `model_dir`'s config on the meta device (no weights are
    read, nothing is allocated), so `tidal grpo` refuses a wrong name before anything starts."""
    if targets == ALL_LINEAR:
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    resolve_lora_targets(model, targets, (getattr(config, "architectures", None) or [type(model).__name__])[0])
