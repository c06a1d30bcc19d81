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
- **activations of one micro-batch** (`rows * sequence_len` tokens): per decoder layer and token what HF
  transformers + PEFT keep for the backward (`layer_bytes_per_token`: LoRA's float32 input copies, the float32
  RMSNorm upcasts, q/k/v/attention output, SwiGLU's gate/up/act: ~97 KB for the Qwen3-0.6B shape in bf16);
  with a dense (rows, 1, T, T) attention mask (the CUDA trainer's SDPA on packed rows) the boolean mask once and
  a bias in the training dtype per layer (T^2 terms: they dominate long rows). With activation checkpointing
  only each layer's input is kept, plus one layer's full set while it is recomputed. Held within 15% of the
  CUDA peaks measured on an H100 (issue 26; tests/unit/test_memory.py);
- **logits**: with chunked log-probabilities (`logprob_chunk_size` > 0) a few fp32 (chunk, vocab) buffers;
  without, the full (tokens, vocab) logits in the training dtype plus three fp32 copies;
- **CUDA overhead** (context, allocator slack, cuBLAS workspaces): a fixed 1 GiB;
- a 10% margin on the sum.
`Footprint.allocated` is what `torch.cuda.max_memory_allocated` reports (no overhead, no margin); `total` sizes the
trainer's share of a GPU (`tidal.colocate.split`, which also takes a measured peak: `calibrate`). The trainer logs
its measured peak as `memory/peak_gb` and warns once when it goes past the estimate; a CUDA out-of-memory error
ends it with `oom_message` (`tidal.trainer.memory`; the calibration step: `tidal.trainer.calibrate`). The estimate
is torch-free, so the co-locate derivation can call it before anything starts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tidal.config.train import DEFAULT_LOGPROB_CHUNK_SIZE
from tidal.models.config import model_config as read_model_config
from tidal.models.config import text_config

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
    def allocated(self) -> int:
        """What PyTorch's allocator holds at the peak (`torch.cuda.max_memory_allocated`): every part but the
        CUDA overhead, without the margin."""
        return self.weights + self.lora + self.activations + self.logits

    @property
    def total(self) -> int:
        """The sum with the 10% margin."""
        return int((self.weights + self.lora + self.activations + self.logits + self.overhead) * (1 + MARGIN))

    @property
    def total_gib(self) -> float:
        return self.total / GIB


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
    cfg = text_config(cfg)
    shapes = linear_shapes(cfg)
    attn = sum(i * o for k, (i, o) in shapes.items() if k.endswith(("q_proj", "k_proj", "v_proj", "o_proj")))
    mlp = sum(i * o for k, (i, o) in shapes.items() if k in ("gate_proj", "up_proj", "down_proj"))
    experts = int(cfg.get("num_experts") or 1)
    router = int(cfg["hidden_size"]) * experts if experts > 1 else 0
    embed = int(cfg["vocab_size"]) * int(cfg["hidden_size"]) * (1 if cfg.get("tie_word_embeddings") else 2)
    return int(cfg["num_hidden_layers"]) * (attn + mlp * experts + router) + embed


def lora_parameter_count(cfg: Mapping[str, Any], rank: int, targets: Iterable[str]) -> int:
    """LoRA parameters (r * (in + out) per adapted linear) for the named target modules of every layer."""
    cfg = text_config(cfg)
    shapes = linear_shapes(cfg)
    wanted = set(targets)
    if "all-linear" in wanted:
        wanted = set(shapes)
    experts = int(cfg.get("num_experts") or 1)
    per_layer = sum(rank * (i + o) * (experts if k in ("gate_proj", "up_proj", "down_proj") else 1)
                    for k, (i, o) in shapes.items() if k in wanted)
    return int(cfg["num_hidden_layers"]) * per_layer


def layer_bytes_per_token(cfg: Mapping[str, Any], b: int, lora_targets: set[str] | None, dense_mask: bool) -> int:
    """Bytes one decoder layer keeps for its backward per token (HF transformers + PEFT, no checkpointing), counted
    from what autograd saves on a real Qwen3 layer (`torch.autograd.graph.saved_tensors_hooks`, tests/unit/
    test_memory.py) and matching the CUDA peaks of issue 26 (92.8 KB/token/layer for the 0.6B shape on CPU, ~97 KB
    with the GPU's masked SDPA):
    - frozen base linears keep no input; LoRA's A matmul keeps its input cast to the adapters' float32 (PEFT keeps
      adapters in float32), one copy per adapted module (q, k and v each cast the same hidden state); full
      fine-tuning keeps each distinct linear input once in the training dtype;
    - the two RMSNorms keep a float32 upcast of the hidden state each, Qwen3's q/k norms one of q and k;
    - attention keeps q, k, v and its output (k and v at query width when a dense mask makes SDPA repeat them:
      GQA without `enable_gqa`), the MLP gate, up and act(gate) (SwiGLU)."""
    h, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    shapes = linear_shapes(cfg)
    q, kv = shapes["q_proj"][1], shapes["k_proj"][1]
    inputs = {k: i for k, (i, _) in shapes.items()}
    if lora_targets is None:  # full fine-tuning: q/k/v share one input, gate/up another
        kept_inputs = (2 * h + q + inter) * b
    elif b < 4:  # each adapted module casts its input to float32
        kept_inputs = sum(inputs[k] for k in lora_targets if k in inputs) * 4
    else:  # float32 training: the cast is a no-op, shared inputs are kept once
        wanted = {("qkv" if k in ("q_proj", "k_proj", "v_proj") else "mlp" if k in ("gate_proj", "up_proj") else k)
                  for k in lora_targets if k in inputs}
        kept_inputs = sum({"qkv": h, "mlp": h, "o_proj": q, "down_proj": inter}[k] for k in wanted) * 4
    qk_norm = (q + kv) * 4 if str(cfg.get("model_type", "qwen3")).startswith("qwen3") else 0
    attention = (2 * q + 2 * (q if dense_mask else kv)) * b
    return kept_inputs + 2 * h * 4 + qk_norm + attention + 3 * inter * b


def estimate(model_config: Mapping[str, Any], *, dtype: str = "bfloat16", lora_rank: int | None = 16,
             lora_targets: Iterable[str] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"),
             rows: int = 1, sequence_len: int = 2048, gradient_checkpointing: bool = False,
             logprob_chunk_size: int = DEFAULT_LOGPROB_CHUNK_SIZE, base: str | None = None,
             optimizer_8bit: bool = False, dense_mask: bool = True, checkpoint_every: int = 1,
             checkpoint_scope: str = "layer", offload_activations: bool = False) -> Footprint:
    """The trainer's footprint for one micro-batch of `rows` packed rows of `sequence_len` tokens (see the module
    doc); `lora_rank` None: full fine-tuning (every parameter trained); `base`: `nf4` / `fp8` for a QLoRA base;
    `optimizer_8bit`: AdamW moments in 8 bits; `dense_mask`: attention gets a (rows, 1, T, T) mask (the CUDA
    trainer's SDPA on packed rows today), which SDPA keeps per layer as a bias in the training dtype.
    `checkpoint_every` / `checkpoint_scope` / `offload_activations` (`tidal.trainer.model.activations`): only every k-th
    layer checkpointed, the others keeping their full set; `mlp` and `elementwise` scopes counted as not
    checkpointed (upper bounds: `mlp` keeps the attention's part, `elementwise` every matmul's output);
    offloaded layers keep nothing on the device but the one in flight."""
    cfg = text_config(model_config)
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
    targets = set(lora_targets)
    if "all-linear" in targets:
        targets = set(linear_shapes(cfg))
    trained = lora_parameter_count(cfg, lora_rank, targets) if lora_rank else params
    moments = MOMENT_BYTES[optimizer_8bit]
    h, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    tokens = rows * sequence_len
    per_layer = tokens * layer_bytes_per_token(cfg, b, targets if lora_rank else None, dense_mask)
    # (rows, 1, T, T) boolean mask once, plus the bias SDPA derives from it per layer (kept for the backward)
    mask_bool, mask_bias = (rows * sequence_len**2, rows * sequence_len**2 * b) if dense_mask else (0, 0)
    # layers whose input alone is kept (recomputed in the backward), and layers keeping their full set
    recomputed = (-(-layers // checkpoint_every) if gradient_checkpointing and checkpoint_scope == "layer" else 0)
    kept = 0 if offload_activations else layers - recomputed  # offloaded: in pinned CPU memory
    activations = recomputed * tokens * h * b + kept * (per_layer + mask_bias) + mask_bool
    if recomputed or offload_activations:  # one layer's full set while it is recomputed / copied back
        activations += per_layer + mask_bias
    vocab = int(cfg["vocab_size"])
    logits = 3 * 4 * min(logprob_chunk_size, tokens) * vocab if logprob_chunk_size > 0 else tokens * vocab * (b + 12)
    return Footprint(weights=weights, lora=int(trained * (8 + moments) if lora_rank else trained * (b + 4 + moments)),
                     activations=activations, logits=logits, overhead=CUDA_OVERHEAD_BYTES)


def train_estimate(train: Any, gradient_checkpointing: bool | None = None, dense_mask: bool | None = None,
                   model_config: Mapping[str, Any] | None = None, dtype: str | None = None) -> Footprint:
    """The estimated GPU footprint of the trainer `train` (a TrainConfig) describes, from its model's config.json
    (torch-free). `gradient_checkpointing` None: train's own (`auto` counts as on only when it is resolved: pass a
    bool). `dense_mask` None: only with train `attention: dense` (flex / per-sample kernels build no (T, T) mask;
    a model flex cannot serve falls back to it, which the split's calibration step measures). `model_config`: the
    model's config.json when the caller has read it already. `dtype`: the training dtype (None: float32 with train
    `recipe: fp32`, else bfloat16, the GPU's)."""
    if model_config is None:
        model_config = read_model_config(train.model)
    targets = [train.lora_target_modules] if isinstance(train.lora_target_modules, str) else train.lora_target_modules
    ckpt = train.gradient_checkpointing is True if gradient_checkpointing is None else gradient_checkpointing
    rows = (train.micro_batch_tokens // train.sequence_len if train.micro_batch_tokens
            else train.per_device_train_batch_size)
    return estimate(model_config, dtype=dtype or ("float32" if train.recipe == "fp32" else "bfloat16"),
                    lora_rank=train.lora_rank if train.lora else None, lora_targets=targets,
                    rows=rows, sequence_len=train.sequence_len, gradient_checkpointing=ckpt,
                    logprob_chunk_size=train.logprob_chunk_size,
                    base="nf4" if train.qlora_bnb else "fp8" if train.qlora_fp8 else None,
                    optimizer_8bit=train.optimizer == "adamw_8bit",
                    dense_mask=(train.attention == "dense" or bool(text_config(model_config).get(
                        "attn_logit_softcapping"))) if dense_mask is None else dense_mask,  # softcap: SDPA
                    checkpoint_every=getattr(train, "checkpoint_every", 1),
                    checkpoint_scope=getattr(train, "checkpoint_scope", "layer"),
                    offload_activations=getattr(train, "offload_activations", False))


def train_footprint_gib(train: Any) -> float:
    """The estimated GPU footprint in GiB (`Footprint.total`) of the trainer `train` describes (torch-free)."""
    return train_estimate(train).total_gib


def checkpointing_needed(estimate_off_gib: float, available_gib: float) -> bool:
    """`gradient_checkpointing: auto` outside `tidal grpo`'s split: on when the trainer's estimate without it does
    not fit in what the device has free (`tidal grpo` decides with the split instead: `tidal.colocate.split`)."""
    return estimate_off_gib > available_gib
