"""The trainer's GPU memory footprint, estimated before it starts (the co-locate memory split) and measured
while it runs.

`estimate(model_config, ...)` reads a Hugging Face `config.json` dict (no torch, no weights loaded) and adds up,
in bytes (seed 000 "Automatic memory management"):
- **weights**: every parameter in the training dtype (embeddings counted twice when untied; MoE experts all
  resident); with a QLoRA base (train `qlora_bnb` / `qlora_fp8`) the decoder layers' linear weights (not fused
  MoE experts) in their
  quantized format instead (`BASE_BYTES_PER_PARAM`: NF4 codes + double-quantized scales, FP8 codes + one float32
  per 128), plus three dequantized weights of the largest linear in flight (seed 000's dequantization buffers);
- **LoRA state**: r * (in + out) parameters per adapted linear, each with fp32 weight and gradient and the two
  AdamW moments: 16 bytes per parameter, or 10 with `optimizer: adamw_8bit` (8-bit moments plus a float32
  scale per 256 values); full fine-tuning: gradient and fp32 master beside the weight, and the moments;
- **activations of one micro-batch** (`rows * sequence_len` tokens): per decoder layer and token the tensors
  autograd keeps for a SwiGLU block with fused (flash/SDPA) attention, about 8 h + 2 kv + 5 I values of the
  training dtype (h hidden, kv the key/value width, I the MLP width; no seq^2 term). With activation
  checkpointing only each layer's input is kept, plus one layer's full set while it is recomputed;
- **logits**: with chunked log-probabilities (`logprob_chunk_size` > 0) a few fp32 (chunk, vocab) buffers;
  without, the full (tokens, vocab) logits in the training dtype plus three fp32 copies;
- **CUDA overhead** (context, allocator slack, cuBLAS workspaces): a fixed 1 GiB;
- a 10% margin on the sum.
It is an estimate for sizing vLLM's share (`gpu_memory_utilization`), not a guarantee: the trainer logs its
measured peak as `memory/peak_gb` and warns once when it goes past the estimate. Torch-free, so the co-locate
derivation can call it before anything starts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tidal.config.train import DEFAULT_LOGPROB_CHUNK_SIZE

GIB = 1024**3
CUDA_OVERHEAD_BYTES = 1 * GIB
MARGIN = 0.10
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
BASE_BYTES_PER_PARAM = {"nf4": 0.5 + 1 / 64 + 4 / (64 * 256), "fp8": 1 + 4 / 128}
"""Bytes per quantized linear weight: NF4 (4-bit codes, an 8-bit absmax per 64 values, a float32 per 256 absmaxes)
and FP8 (e4m3 codes, a float32 scale per 128 values)."""
MOMENT_BYTES = {False: 8.0, True: 2 + 2 * 4 / 256}
"""AdamW's two moments per trained parameter: float32, or 8-bit with one float32 scale per 256 values each."""


@dataclass(frozen=True)
class Footprint:
    """The estimate's parts, in bytes."""

    weights: int
    lora: int
    activations: int
    logits: int
    overhead: int

    @property
    def total(self) -> int:
        """The sum with the 10% margin."""
        return int((self.weights + self.lora + self.activations + self.logits + self.overhead) * (1 + MARGIN))

    @property
    def total_gib(self) -> float:
        return self.total / GIB


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config (vision-language configs nest it under `text_config`)."""
    return cfg.get("text_config") or cfg


def linear_shapes(cfg: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear kind of one decoder layer, by module name (dense MLP width; MoE below)."""
    h = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or h // heads)
    kv = int(cfg.get("num_key_value_heads") or heads) * head_dim
    inter = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if cfg.get("num_experts") else int(
        cfg["intermediate_size"])
    return {"q_proj": (h, heads * head_dim), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (heads * head_dim, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def parameter_count(cfg: Mapping[str, Any]) -> int:
    """Parameters of a decoder-only model from its config (norms and biases left out: < 0.1%)."""
    cfg = _text_config(cfg)
    shapes = linear_shapes(cfg)
    attn = sum(i * o for k, (i, o) in shapes.items() if k.endswith(("q_proj", "k_proj", "v_proj", "o_proj")))
    mlp = sum(i * o for k, (i, o) in shapes.items() if k in ("gate_proj", "up_proj", "down_proj"))
    experts = int(cfg.get("num_experts") or 1)
    router = int(cfg["hidden_size"]) * experts if experts > 1 else 0
    embed = int(cfg["vocab_size"]) * int(cfg["hidden_size"]) * (1 if cfg.get("tie_word_embeddings") else 2)
    return int(cfg["num_hidden_layers"]) * (attn + mlp * experts + router) + embed


def lora_parameter_count(cfg: Mapping[str, Any], rank: int, targets: Iterable[str]) -> int:
    """LoRA parameters (r * (in + out) per adapted linear) for the named target modules of every layer."""
    cfg = _text_config(cfg)
    shapes = linear_shapes(cfg)
    wanted = set(targets)
    if "all-linear" in wanted:
        wanted = set(shapes)
    experts = int(cfg.get("num_experts") or 1)
    per_layer = sum(rank * (i + o) * (experts if k in ("gate_proj", "up_proj", "down_proj") else 1)
                    for k, (i, o) in shapes.items() if k in wanted)
    return int(cfg["num_hidden_layers"]) * per_layer


def estimate(model_config: Mapping[str, Any], *, dtype: str = "bfloat16", lora_rank: int | None = 16,
             lora_targets: Iterable[str] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"),
             rows: int = 1, sequence_len: int = 2048, gradient_checkpointing: bool = False,
             logprob_chunk_size: int = DEFAULT_LOGPROB_CHUNK_SIZE, base: str | None = None,
             optimizer_8bit: bool = False) -> Footprint:
    """The trainer's footprint for one micro-batch of `rows` packed rows of `sequence_len` tokens (see the module
    doc); `lora_rank` None: full fine-tuning (every parameter trained); `base`: `nf4` / `fp8` for a QLoRA base;
    `optimizer_8bit`: AdamW moments in 8 bits."""
    cfg = _text_config(model_config)
    b = DTYPE_BYTES[dtype]
    params = parameter_count(cfg)
    weights = params * b
    if base is not None:  # decoder linears quantized, embeddings / lm_head / norms not
        shapes = linear_shapes(cfg)
        attn = sum(i * o for k, (i, o) in shapes.items() if k.endswith(("q_proj", "k_proj", "v_proj", "o_proj")))
        mlp = 0 if cfg.get("num_experts") else sum(i * o for k, (i, o) in shapes.items()
                                                     if k in ("gate_proj", "up_proj", "down_proj"))
        linear = int(cfg["num_hidden_layers"]) * (attn + mlp)  # MoE experts are fused tensors, not quantized
        largest = max(i * o for i, o in shapes.values())
        weights = int((params - linear) * b + linear * BASE_BYTES_PER_PARAM[base] + 3 * largest * b)
    trained = lora_parameter_count(cfg, lora_rank, lora_targets) if lora_rank else params
    moments = MOMENT_BYTES[optimizer_8bit]
    h, inter, layers = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"])
    kv = linear_shapes(cfg)["k_proj"][1]
    tokens = rows * sequence_len
    per_layer = tokens * (8 * h + 2 * kv + 5 * inter) * b
    activations = (layers * tokens * h * b + per_layer) if gradient_checkpointing else layers * per_layer
    vocab = int(cfg["vocab_size"])
    logits = 3 * 4 * min(logprob_chunk_size, tokens) * vocab if logprob_chunk_size > 0 else tokens * vocab * (b + 12)
    return Footprint(weights=weights, lora=int(trained * (8 + moments) if lora_rank else trained * (b + 4 + moments)),
                     activations=activations, logits=logits, overhead=CUDA_OVERHEAD_BYTES)


# --- measured while it runs (torch imported lazily: the estimate above stays torch-free) -------------------------

def reset_peak(device: Any) -> None:
    """Start a new peak: CUDA's allocator peak, or on CPU the process's peak resident set (Linux `clear_refs`)."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass  # not Linux, or not allowed: the peak then covers the process's whole life


def peak_gib(device: Any) -> float:
    """Peak memory since `reset_peak`, GiB: torch.cuda.max_memory_allocated on CUDA, peak RSS (VmHWM) on CPU."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def train_footprint_gib(train: Any) -> float:
    """The estimated GPU footprint in GiB of the trainer `train` (a TrainConfig) describes, from its model's
    config.json (torch-free)."""
    import json
    from pathlib import Path

    from tidal.assets import resolve_model

    model_config = json.loads((Path(resolve_model(train.model)) / "config.json").read_text())
    targets = [train.lora_target_modules] if isinstance(train.lora_target_modules, str) else train.lora_target_modules
    return estimate(model_config, dtype="float32" if train.recipe == "fp32" else "bfloat16",
                    lora_rank=train.lora_rank if train.lora else None, lora_targets=targets,
                    rows=train.per_device_train_batch_size, sequence_len=train.sequence_len,
                    gradient_checkpointing=train.gradient_checkpointing,
                    logprob_chunk_size=train.logprob_chunk_size,
                    base="nf4" if train.qlora_bnb else "fp8" if train.qlora_fp8 else None,
                    optimizer_8bit=train.optimizer == "adamw_8bit").total_gib
