"""The trainer's GPU memory footprint, estimated before it starts (the co-locate memory split) and measured
while it runs.

`estimate(model_config, ...)` reads a Hugging Face `config.json` dict (no torch, no weights loaded) and adds up,
in bytes (seed 000 "Automatic memory management"):
- **weights**: every parameter in the training dtype (embeddings counted twice when untied; MoE experts all
  resident);
- **LoRA state**: r * (in + out) parameters per adapted linear, each with fp32 weight, gradient and the two
  AdamW moments (16 bytes per parameter);
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
             logprob_chunk_size: int = DEFAULT_LOGPROB_CHUNK_SIZE) -> Footprint:
    """The trainer's footprint for one micro-batch of `rows` packed rows of `sequence_len` tokens (see the module
    doc); `lora_rank` None: full fine-tuning (every parameter trained)."""
    cfg = _text_config(model_config)
    b = DTYPE_BYTES[dtype]
    params = parameter_count(cfg)
    trained = lora_parameter_count(cfg, lora_rank, lora_targets) if lora_rank else params
    h, inter, layers = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"])
    kv = linear_shapes(cfg)["k_proj"][1]
    tokens = rows * sequence_len
    per_layer = tokens * (8 * h + 2 * kv + 5 * inter) * b
    activations = (layers * tokens * h * b + per_layer) if gradient_checkpointing else layers * per_layer
    vocab = int(cfg["vocab_size"])
    logits = 3 * 4 * min(logprob_chunk_size, tokens) * vocab if logprob_chunk_size > 0 else tokens * vocab * (b + 12)
    return Footprint(weights=params * b, lora=trained * 16 if lora_rank else trained * (b + 12),
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
                    logprob_chunk_size=train.logprob_chunk_size).total_gib
