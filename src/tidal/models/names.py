"""Weight names: the trainer's parameters under the checkpoint's tensor names, which vLLM's `load_weights`
(merged reloads, the NCCL/gloo push) and `from_pretrained` read.

transformers 5 converts some checkpoint layouts at load time: the experts of a mixture-of-experts layer
(`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight` in the checkpoint) become two fused 3-d parameters
(`mlp.experts.gate_up_proj` (E, 2I, H), `mlp.experts.down_proj` (E, H, I)). `checkpoint_tensors` undoes
this per parameter with transformers' own reverse conversion (`revert_weight_conversion`, what
`save_pretrained` uses), so names and shapes match the checkpoint again; parameters without a conversion
(fused `qkv_proj` / `gate_up_proj` of Phi-3, which the checkpoint has fused too) keep their names. Tied
embeddings appear once, as the input embedding (vLLM ties its lm_head to it; checkpoints of tied models have
no `lm_head.weight`). PEFT wrapping (`base_model.model.` prefixes, `.base_layer` inserts) is removed first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

PEFT_PREFIX = "base_model.model."
EXPERT_PART = ".experts."
"""What the checkpoint names of routed experts' weights contain (Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek)."""


def is_expert_key(key: str) -> bool:
    """A checkpoint tensor of a routed expert (`model.layers.0.mlp.experts.3.up_proj.weight`)."""
    return EXPERT_PART in key


def config_is_moe(config: Any) -> bool:
    """A transformers config of a mixture-of-experts model (`tidal.models.arch.EXPERT_KEYS`)."""
    from tidal.models.arch import EXPERT_KEYS
    from tidal.models.config import text_config

    d = text_config(config.to_dict())
    return any(isinstance(d.get(k), int) and d[k] > 0 for k in EXPERT_KEYS)


def plain_name(name: str) -> str:
    """A parameter name of a PEFT-wrapped model -> the base model's name (`...q_proj.base_layer.weight` ->
    `...q_proj.weight`)."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def unwrap(model: Any) -> Any:
    """The transformers model inside a PEFT model (`model` itself when it is not one)."""
    return model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model


def checkpoint_tensors(model: Any, named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """(checkpoint name, tensor) for each (trainer name, tensor) in `named`, one parameter at a time: a fused
    MoE expert parameter yields one tensor per expert and projection (views, no copies)."""
    from transformers.core_model_loading import revert_weight_conversion

    base = unwrap(model)
    for name, tensor in named:
        yield from revert_weight_conversion(base, {plain_name(name): tensor}).items()


def base_weights(model: Any, dense: Callable[[Any], Any] | None = None) -> Iterator[tuple[str, Any]]:
    """(checkpoint name, tensor) of every parameter and buffer of `model`, PEFT's LoRA factors excepted,
    detached (the base weights of the LoRA-adapted modules unmerged); `dense` turns a parameter into its dense
    tensor (a quantized QLoRA weight dequantized, `tidal.trainer.model.quant.dense_weight`)."""
    base = unwrap(model)
    as_tensor = dense or (lambda p: p.detach())
    named = [(n, as_tensor(p)) for n, p in base.named_parameters() if ".lora_" not in n]
    named += [(n, b.detach()) for n, b in base.named_buffers()]
    yield from checkpoint_tensors(base, named)
