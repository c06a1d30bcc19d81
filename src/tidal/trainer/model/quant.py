"""Quantized frozen bases for QLoRA (train `qlora_bnb`, `qlora_fp8`): how they are loaded, and their dense weights.

The base model's linear layers (every `nn.Linear` but `lm_head`; embeddings and norms stay in the model dtype) are
stored quantized while LoRA adapters train on top in the model dtype:
- `qlora_bnb`: NF4 (4-bit NormalFloat codes, one absmax per 64 values, the absmaxes themselves 8-bit quantized:
  QLoRA's double quantization), through transformers' `BitsAndBytesConfig` and bitsandbytes' `Linear4bit`, which
  PEFT wraps natively. bitsandbytes runs on CUDA and on CPU (its CPU backend), so one library serves both: on CPU
  it is what tests exercise; torchao's NF4 tensor was the alternative, but it has no transformers loader and
  PEFT knows bitsandbytes' layer. Each forward dequantizes the weight to the compute dtype and multiplies.
- `qlora_fp8`: float8 e4m3 codes with one float32 scale per block of 128 values along the input dimension
  (1 x 128 blocks: `amax / 448`), through transformers' `TorchAoConfig` with torchao's `Float8WeightOnlyConfig`
  (`PerGroup(128)`); PEFT wraps it (`TorchaoLoraLinear`). Each forward multiplies the dequantized weight in the
  model dtype, on every device: the same numerics on CPU (tests) and GPU. FP8 *matmuls* are `recipe:
  fp8-hybrid`'s business; the two are not combined (the recipe would re-quantize the dequantized weight).

vLLM must sample the policy the trainer scores, which is the *dequantized* base plus LoRA, not the checkpoint's
original weights: the trainer publishes policy 0 as the dequantized base's full weights (`broadcasts/step_0/
merged`) and later policies' merged weights from the dequantized base too (`tidal.trainer.publish.broadcast`); the
orchestrator reloads policy 0 before its first rollouts (orch `weight_broadcast.policy_zero: published`).
`dense_weight` is the one place that turns a quantized weight back into the tensor the forward multiplies by.

bitsandbytes' CPU inference fast path (`Linear4bit.support_avx512bf16_for_cpu`) repacks the weight in place and
multiplies in bfloat16 the first time a module runs in eval mode without gradients: a different policy than the
one published. `quantize_on_load` turns it off.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import torch

QuantKind = Literal["nf4", "fp8"]
NF4_BLOCK = 64
FP8_BLOCK = 128


def qlora_kind(cfg: Any) -> QuantKind | None:
    """Which quantized base train config `cfg` asks for (`qlora_bnb` -> nf4, `qlora_fp8` -> fp8), or None."""
    if getattr(cfg, "qlora_bnb", False):
        return "nf4"
    if getattr(cfg, "qlora_fp8", False):
        return "fp8"
    return None


def quantization_config(kind: QuantKind, dtype: torch.dtype) -> Any:
    """The transformers `quantization_config` that loads the base with `kind` linear weights (compute in `dtype`)."""
    if kind == "nf4":
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                                  bnb_4bit_use_double_quant=True, llm_int8_skip_modules=["lm_head"])
    from torchao.quantization import Float8WeightOnlyConfig
    from torchao.quantization.granularity import PerGroup
    from transformers import TorchAoConfig

    return TorchAoConfig(quant_type=Float8WeightOnlyConfig(granularity=PerGroup(FP8_BLOCK)),
                         modules_to_not_convert=["lm_head"])


def is_quantized(weight: Any) -> bool:
    """Whether `weight` is a quantized (NF4 or FP8) weight rather than a plain tensor of the model dtype."""
    return hasattr(weight, "quant_state") or (isinstance(weight, torch.Tensor) and hasattr(weight, "qdata"))


def dense_weight(weight: Any) -> torch.Tensor:
    """The dense tensor a quantized `weight` multiplies by (its original dtype); a plain weight detached."""
    if hasattr(weight, "quant_state"):  # bitsandbytes Params4bit
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(weight.data, weight.quant_state)  # type: ignore[no-any-return]
    if hasattr(weight, "qdata"):  # torchao Float8Tensor
        return weight.dequantize().detach()  # type: ignore[no-any-return]
    return weight.detach()  # type: ignore[no-any-return]


def dense_spec(module: Any) -> tuple[torch.dtype, list[int]]:
    """(dtype, shape) of `dense_weight(module.weight)`, without dequantizing it."""
    weight: Any = module.weight
    if hasattr(weight, "quant_state"):
        return weight.quant_state.dtype, [int(module.out_features), int(module.in_features)]
    return weight.dtype, list(weight.shape)


def quantized_linears(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """(module name, module) of every linear layer of `model` holding a quantized weight."""
    for name, module in model.named_modules():
        if is_quantized(getattr(module, "weight", None)) and not name.endswith(".base_layer"):
            yield name, module


def storage_bytes(weight: Any) -> int:
    """Bytes a quantized weight occupies: codes plus scales (and the nested scales of double quantization)."""
    if hasattr(weight, "quant_state"):
        qs = weight.quant_state
        total = weight.data.numel() * weight.data.element_size() + qs.absmax.numel() * qs.absmax.element_size()
        if qs.nested:
            total += qs.state2.absmax.numel() * qs.state2.absmax.element_size() + 256 * 4  # + code book
        return int(total)
    if hasattr(weight, "qdata"):
        codes, scale = weight.qdata, weight.scale
        return int(codes.numel() * codes.element_size() + scale.numel() * scale.element_size())
    return int(weight.numel() * weight.element_size())


def base_report(model: torch.nn.Module, kind: QuantKind) -> dict[str, float]:
    """The quantized base's footprint: linear layers, their parameters, bytes, bytes per parameter."""
    layers = params = stored = 0
    for _, module in quantized_linears(model):
        layers += 1
        params += int(module.in_features) * int(module.out_features)
        stored += storage_bytes(module.weight)
    return {"layers": layers, "params": params, "bytes": stored, "bytes_per_param": stored / max(params, 1)}


def quantize_on_load(model: torch.nn.Module) -> None:
    """After loading a quantized base: keep bitsandbytes' CPU modules on the exact path (see the module doc)."""
    for _, module in quantized_linears(model):
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
