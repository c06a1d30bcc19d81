"""One GPU shared by vLLM and the trainer (`tidal grpo`): each gets what it needs, and a run that cannot fit
exits 2 before anything starts, instead of running out of memory later.

vLLM is sized by need, not by what is left (`vllm_need`):
- **KV cache** for the largest number of tokens the run can have in vLLM at once: the sequences in flight (orch
  `batch_size` x `oversampling_factor` in `async_mode: gated`, where each batch samples all its groups and the
  pipeline drains between batches; `in_flight_groups` x `rollouts_per_example` in `async_mode: in_flight`; at
  most vLLM's `max_num_seqs`; shared by infer `dp` servers, each on its own GPU) x orch `seq_len` tokens, rounded
  up to vLLM's 16-token blocks, plus
  `KV_HEADROOM`. Bytes per token from the model's config (`kv_bytes_per_token`: layers x KV heads x head_dim x 2
  (K and V) x the dtype's bytes; GQA through `num_key_value_heads`, `head_dim` when the config has it, MLA's
  compressed latent where `kv_lora_rank` is set; sliding-window layers are counted as full ones, the safe side);
- **weights** in vLLM's dtype, and its **profile** peak inside `gpu_memory_utilization` (`VLLM_PROFILE_FIXED_GIB`
  plus the activations of one `max_num_batched_tokens` step);
- what vLLM holds **beyond** `gpu_memory_utilization` x total: CUDA graphs and the CUDA context
  (`VLLM_OUTSIDE_GIB`, measured).
Where the installed vLLM has `--kv-cache-memory-bytes`, tidal passes the KV size itself (vLLM then allocates
exactly that and skips its KV profiling) and sets `gpu_memory_utilization` to vLLM's share as well (vLLM checks at
start that this much is free: a restarted server beside a running trainer must pass); otherwise the share alone,
which vLLM fills with KV cache up to that fraction.

The trainer gets the rest. Its need is the larger of the estimate (`tidal.models.memory.estimate`, total with
its overhead and margin) and the peak measured by one micro-batch of the run's largest shape on the GPU before
vLLM starts (`tidal.trainer.calibrate.calibrate`), plus the CUDA context and `CALIBRATION_MARGIN` (`trainer_need_gib`).
Train `gradient_checkpointing: auto` is decided here: off when the trainer's need without it fits in its share,
else on (`plan_split`). When even that does not fit, `ConfigError` names the keys to change.

Pure arithmetic (no torch, no vLLM import): the figures of issue 26 are its test fixtures (tests/unit/
test_split.py, `split_updates`); `gpu_split`, what `tidal.colocate.derive.derive_colocate` calls, adds the
trainer's estimate and calibration.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from tidal.config.infer import InferConfig, round_lora_rank
from tidal.config.load import ConfigError
from tidal.config.orch import OrchConfig
from tidal.config.train import TrainConfig
from tidal.models.config import text_config
from tidal.models.memory import parameter_count, train_estimate
from tidal.models.shared_weights import shared_bytes

GIB = 1024**3
KV_BLOCK_TOKENS = 16
"""vLLM's default KV block size: each sequence holds whole blocks."""
KV_HEADROOM = 0.10
"""KV cache beyond the in-flight tokens (prefix-cache churn, a sequence or two admitted early)."""
VLLM_OUTSIDE_GIB = 2.2
"""Memory vLLM holds beyond `gpu_memory_utilization` x total: CUDA graphs (0.83 GiB) and the CUDA context. Measured
on an H100 (79.18 GiB) with vLLM 0.24.0, a Qwen3-0.6B-shaped model in bf16 with LoRA: 71.89 GiB held at
utilization 0.88 (= 69.68 GiB), 2.21 GiB over (issue 26, 2026-11-24)."""
VLLM_PROFILE_FIXED_GIB = 1.06
"""vLLM's memory inside its utilization budget that is neither weights, KV cache nor step activations (sampler
buffers for `max_num_seqs`, LoRA slots, allocator and NCCL buffers). Same measurement: 69.68 GiB budget - 67.35 GiB
KV cache - 1.11 GiB weights = 1.22 GiB, less that run's step activations (`profile_activation_bytes`, 0.16 GiB)."""
VLLM_MAX_NUM_BATCHED_TOKENS = 8192
"""vLLM's default tokens per step for its OpenAI server on a >= 70 GiB GPU (2048 below)."""
TRAINER_CONTEXT_GIB = 1.0
"""What the trainer process holds outside PyTorch's allocator (CUDA context, cuBLAS workspaces): 1,006 MiB measured
on the H100 (issue 26), not in `torch.cuda.max_memory_reserved`."""
CALIBRATION_MARGIN = 0.10
"""Added to a measured trainer peak (fragmentation over a run, a longer step than the calibration's)."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")
"""infer `kv_cache_dtype` values that store one byte per element (vLLM's `--kv-cache-dtype`)."""


def kv_bytes_per_token(model_config: Mapping[str, Any], dtype: str) -> int:
    """KV cache bytes one token takes in vLLM: per layer K and V of `num_key_value_heads` x `head_dim` (GQA), or
    MLA's compressed latent (`kv_lora_rank` + `qk_rope_head_dim`, one vector) where the config has it."""
    cfg = text_config(model_config)
    b = 1 if dtype in KV_FP8 else DTYPE_BYTES[dtype]
    layers = int(cfg["num_hidden_layers"])
    if cfg.get("kv_lora_rank"):  # MLA (DeepSeek-style): one latent per token and layer
        return layers * (int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)) * b
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return layers * kv_heads * head_dim * 2 * b


def sequences_in_flight(orch: OrchConfig, max_num_seqs: int, servers: int = 1) -> int:
    """Sequences one of `servers` vLLM servers (infer `dp`; the orchestrator spreads requests over them) may hold
    at once for orch config `orch` (see the module doc), capped at `max_num_seqs`."""
    if orch.async_mode == "in_flight":
        groups = orch.in_flight_groups or 2 * orch.batch_size // orch.rollouts_per_example
        n = groups * orch.rollouts_per_example
    else:
        n = math.ceil(orch.batch_size * orch.oversampling_factor)
    return min(math.ceil(n / servers), max_num_seqs)


def kv_need_bytes(model_config: Mapping[str, Any], dtype: str, sequences: int, seq_len: int) -> int:
    """KV cache for `sequences` sequences of up to `seq_len` tokens (whole blocks each), plus `KV_HEADROOM`."""
    tokens = sequences * math.ceil(seq_len / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    return int(tokens * kv_bytes_per_token(model_config, dtype) * (1 + KV_HEADROOM))


def profile_activation_bytes(model_config: Mapping[str, Any], dtype: str,
                             tokens: int = VLLM_MAX_NUM_BATCHED_TOKENS) -> int:
    """vLLM's step activations at `tokens` tokens (no autograd: the widest live tensors of one layer, SwiGLU's
    gate+up and a few hidden-size buffers)."""
    cfg = text_config(model_config)
    return tokens * (2 * int(cfg["intermediate_size"]) + 4 * int(cfg["hidden_size"])) * DTYPE_BYTES[dtype]


LORA_SHAPES = {"q_proj": ("h", "q"), "k_proj": ("h", "kv"), "v_proj": ("h", "kv"), "o_proj": ("q", "h"),
               "gate_proj": ("h", "i"), "up_proj": ("h", "i"), "down_proj": ("i", "h"),
               "qkv_proj": ("h", "qkv"), "gate_up_proj": ("h", "i2")}
"""(input, output) of each LoRA target a decoder layer has, by the config sizes of `lora_slot_bytes`."""


def lora_slot_bytes(model_config: Mapping[str, Any], dtype: str, max_loras: int, rank: int,
                    targets: str | list[str]) -> int:
    """vLLM's LoRA slots: for every wrapped module of every layer, `max_loras` stacked A (rank x in) and B
    (out x rank) in the model's dtype (vLLM 0.24 `lora/layers/base_linear.py`: allocated at start whether adapters
    are loaded or not). `targets`: infer `lora_target_modules` (`all-linear`: q/k/v/o/gate/up/down; a name this
    table does not know counts as the widest projection, the safe side)."""
    cfg = text_config(model_config)
    h, i = int(cfg["hidden_size"]), int(cfg.get("intermediate_size") or 4 * int(cfg["hidden_size"]))
    heads = int(cfg["num_attention_heads"])
    hd = int(cfg.get("head_dim") or h // heads)
    kv = int(cfg.get("num_key_value_heads") or heads) * hd
    size = {"h": h, "i": i, "i2": 2 * i, "q": heads * hd, "kv": kv, "qkv": heads * hd + 2 * kv}
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] \
        if targets == "all-linear" else ([targets] if isinstance(targets, str) else targets)
    per_layer = sum(size[LORA_SHAPES[n][0]] + size[LORA_SHAPES[n][1]] if n in LORA_SHAPES else h + 2 * i
                    for n in names)
    return int(cfg["num_hidden_layers"]) * per_layer * rank * max_loras * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class VllmNeed:
    """What vLLM holds on the GPU, bytes."""

    weights: int
    profile: int
    kv_cache: int
    outside: int
    lora: int = 0
    """LoRA slots (`lora_slot_bytes`; 0 without LoRA)."""

    @property
    def budget(self) -> int:
        """The part inside `gpu_memory_utilization` x total (weights, LoRA slots, profile peak, KV cache)."""
        return self.weights + self.lora + self.profile + self.kv_cache

    @property
    def total(self) -> int:
        return self.budget + self.outside


def vllm_need(model_config: Mapping[str, Any], dtype: str, sequences: int, seq_len: int, params: int,
              tp: int = 1, kv_dtype: str = "auto", lora: int = 0) -> VllmNeed:
    """What one GPU of a vLLM server holds for `sequences` sequences of `seq_len` tokens of this model (`params`
    parameters) in `dtype` (module doc); with tensor parallelism `tp` each GPU holds 1/tp of the weights and of
    the KV cache (KV heads are split over the ranks). `kv_dtype`: infer `kv_cache_dtype` (`auto`: `dtype`).
    `lora`: the LoRA slots' bytes (`lora_slot_bytes`; split over `tp` too)."""
    return VllmNeed(weights=params * DTYPE_BYTES[dtype] // tp, lora=lora // tp,
                    profile=int(VLLM_PROFILE_FIXED_GIB * GIB) + profile_activation_bytes(model_config, dtype) // tp,
                    kv_cache=kv_need_bytes(model_config, dtype if kv_dtype == "auto" else kv_dtype, sequences,
                                           seq_len) // tp,
                    outside=int(VLLM_OUTSIDE_GIB * GIB))


def gpu_share(need: VllmNeed, total_gib: float) -> float:
    """The `gpu_memory_utilization` holding `need`'s budget on a GPU of `total_gib`, rounded up to 0.01 (the
    policy's vLLM and a teacher server alike)."""
    return math.ceil(need.budget / GIB / total_gib * 100) / 100


def trainer_need_gib(estimate_gib: float, measured_gib: float | None) -> float:
    """The trainer's need: the estimate (its total: overhead and margin included), or the measured peak
    (`torch.cuda.max_memory_reserved` of the calibration step) plus the CUDA context and `CALIBRATION_MARGIN`
    when that is larger."""
    if measured_gib is None:
        return estimate_gib
    return max(estimate_gib, (measured_gib + TRAINER_CONTEXT_GIB) * (1 + CALIBRATION_MARGIN))


@dataclass(frozen=True)
class GpuSplit:
    """The split of one GPU (`plan_split`)."""

    total_gib: float
    vllm: VllmNeed
    gpu_memory_utilization: float
    """vLLM's share, rounded up to 0.01 (what vLLM checks is free at its start)."""
    kv_cache_memory_bytes: int | None
    """Passed to vLLM where it has `--kv-cache-memory-bytes` (else None: the share sizes its KV cache)."""
    trainer_gib: float
    """The trainer's need (`trainer_need_gib`)."""
    gradient_checkpointing: bool
    sequences: int
    seq_len: int
    measured_gib: float | None = None
    """The calibration step's peak (reserved), when it was measured."""
    reserved_gib: float = 0.0
    """Held by another process on the GPU (a teacher server), outside both shares."""

    @property
    def vllm_gib(self) -> float:
        """What vLLM holds: its share plus what it holds beyond it."""
        return self.gpu_memory_utilization * self.total_gib + self.vllm.outside / GIB

    @property
    def trainer_room_gib(self) -> float:
        return self.total_gib - self.vllm_gib - self.reserved_gib

    def notice(self) -> str:
        kv = self.vllm.kv_cache / GIB
        how = f"kv_cache_memory_bytes {self.kv_cache_memory_bytes}, " if self.kv_cache_memory_bytes else ""
        basis = f"measured {self.measured_gib:.1f} GiB" if self.measured_gib is not None else "estimate"
        return (f"GPU ({self.total_gib:.1f} GiB): vLLM {self.vllm_gib:.1f} GiB ({how}gpu_memory_utilization "
                f"{self.gpu_memory_utilization}: KV cache {kv:.1f} GiB for {self.sequences} sequences x {self.seq_len} "
                f"tokens, weights {self.vllm.weights / GIB:.1f}, CUDA graphs + context {self.vllm.outside / GIB:.1f}); "
                f"trainer needs {self.trainer_gib:.1f} of the {self.trainer_room_gib:.1f} GiB left ({basis}, gradient "
                f"checkpointing {'on' if self.gradient_checkpointing else 'off'})")


def plan_split(total_gib: float, vllm: VllmNeed, *, sequences: int, seq_len: int, kv_bytes_arg: bool,
               checkpointing: bool | Literal["auto"], estimate_gib: Callable[[bool], float],
               measure_gib: Callable[[bool], float | None] | None = None, reserved_gib: float = 0.0) -> GpuSplit:
    """Split a GPU of `total_gib` between vLLM (`vllm`) and the trainer, after `reserved_gib` held by another
    process on it (a teacher server: `tidal.colocate.teacher`). `estimate_gib(ckpt)`: the trainer's
    estimate with or without activation checkpointing; `measure_gib(ckpt)`: its measured peak (None: not
    measured). `checkpointing: auto` tries without first (no recomputation) and takes checkpointing when the
    trainer would not fit without; an estimate that already does not fit is not measured. Raises ConfigError
    naming the keys to change when the two cannot both fit."""
    share = gpu_share(vllm, total_gib)
    room = total_gib - share * total_gib - vllm.outside / GIB - reserved_gib
    options = [False, True] if checkpointing == "auto" else [bool(checkpointing)]
    need, ckpt, est, measured = 0.0, options[-1], 0.0, None
    for ckpt in options:
        est = estimate_gib(ckpt)
        if est > room and ckpt != options[-1]:
            continue
        measured = measure_gib(ckpt) if measure_gib is not None and est <= room else None
        need = trainer_need_gib(est, measured)
        if need <= room:
            break
    if need > room or share > 1:
        teacher = f", a teacher server {reserved_gib:.1f}" if reserved_gib else ""
        got = f"estimate {est:.1f} GiB"
        if measured is not None:
            got += (", its calibration step ran out of memory on the empty GPU" if math.isinf(measured)
                    else f", measured peak {measured:.1f} GiB")
        lora = f", LoRA slots {vllm.lora / GIB:.1f}" if vllm.lora else ""
        raise ConfigError(
            f"vLLM and the trainer do not both fit on this {total_gib:.1f} GiB GPU: vLLM needs "
            f"{vllm.total / GIB:.1f} GiB (KV cache {vllm.kv_cache / GIB:.1f} GiB for {sequences} sequences x "
            f"{seq_len} tokens, weights {vllm.weights / GIB:.1f}{lora}, CUDA graphs + context "
            f"{vllm.outside / GIB:.1f}){teacher}, the trainer {need:.1f} GiB ({got}; gradient checkpointing "
            f"{'on' if ckpt else 'off'}), {max(room, 0.0):.1f} GiB left for it. "
            + fit_advice(total_gib, vllm, sequences, seq_len, est, reserved_gib, ckpt))
    return GpuSplit(total_gib=total_gib, vllm=vllm, gpu_memory_utilization=share,
                    kv_cache_memory_bytes=vllm.kv_cache if kv_bytes_arg else None, trainer_gib=need,
                    gradient_checkpointing=ckpt, sequences=sequences, seq_len=seq_len, measured_gib=measured,
                    reserved_gib=reserved_gib)


def fit_advice(total_gib: float, vllm: VllmNeed, sequences: int, seq_len: int, trainer_gib: float,
               reserved_gib: float, checkpointing: bool) -> str:
    """The keys that make a refused split fit (`plan_split`'s refusal), with the figures that would: what the KV
    cache can hold beside vLLM's weights, LoRA slots, profile peak and outside part, the trainer's `trainer_gib` and
    `reserved_gib`, as a longest `seq_len` for `sequences` sequences and as a number of sequences of `seq_len`
    tokens (when nothing is left for it, the trainer's micro-batch and the model are what must shrink)."""
    fixed = (vllm.weights + vllm.lora + vllm.profile + vllm.outside) / GIB
    kv_room = total_gib - reserved_gib - trainer_gib - fixed
    length = f"orch seq_len ({seq_len}; infer max_model_len and train sequence_len follow it)"
    held = (f"the sequences vLLM holds at once ({sequences}: orch batch_size x oversampling_factor, or in async_mode "
            f"in_flight in_flight_groups x rollouts_per_example; infer --max-num-seqs caps them)")
    trainer = (f"train per_device_train_batch_size or micro_batch_tokens (the trainer's micro-batch, "
               f"{trainer_gib:.1f} GiB estimated{'' if checkpointing else '; or set gradient_checkpointing: true'})")
    own_gpu = ("or give vLLM a GPU of its own (grpo-infer / grpo-orch / grpo-train, each with its own "
               "CUDA_VISIBLE_DEVICES; there set infer gpu_memory_utilization yourself)")
    if kv_room <= 0 or vllm.kv_cache <= 0:
        return (f"Even without a KV cache, vLLM's weights and fixed parts ({fixed:.1f} GiB) and the trainer "
                f"({trainer_gib:.1f} GiB) exceed the GPU. Keys to lower: {length}, which sizes the trainer's rows "
                f"as well as vLLM's cache; {held}; {trainer}; a QLoRA base (train qlora_bnb) or a smaller model; "
                f"{own_gpu}")
    per_seq = vllm.kv_cache / GIB / sequences
    usable = max(kv_room - 0.01 * total_gib, 0.0)  # vLLM's share is rounded up to 0.01 of the GPU
    fit_seqs = int(usable // per_seq)
    fit_len = int(seq_len * usable / (vllm.kv_cache / GIB)) // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS
    seqs = f"at most {fit_seqs} fit at {seq_len} tokens" if fit_seqs else f"not one fits at {seq_len} tokens"
    fit = f"at most ~{fit_len} tokens fit for {sequences} sequences" if fit_len else "no length fits"
    return (f"Keys to lower ({kv_room:.1f} GiB are left for vLLM's KV cache beside the rest): {length}: {fit}; "
            f"{held}: {seqs}; infer kv_cache_dtype: fp8 (halves the KV cache); {trainer}; {own_gpu}")


def max_num_seqs(infer: InferConfig, total_gib: float) -> int:
    """vLLM's `max_num_seqs`: infer `extra_args` `--max-num-seqs N`, else vLLM's default for its OpenAI server
    (1024 on a >= 70 GiB GPU, 256 below)."""
    args = list(infer.extra_args)
    for i, a in enumerate(args):
        if a == "--max-num-seqs" and i + 1 < len(args):
            return int(args[i + 1])
        if a.startswith("--max-num-seqs="):
            return int(a.split("=", 1)[1])
    return 1024 if total_gib >= 70 else 256


def vllm_dtype(infer: InferConfig, model_config: Mapping[str, Any]) -> str:
    """The dtype vLLM serves in: infer `dtype`, `auto` being the model's (bf16 when it does not say)."""
    if infer.dtype != "auto":
        return str(infer.dtype)
    named = str(text_config(model_config).get("dtype") or model_config.get("torch_dtype") or "bfloat16")
    return named if named in DTYPE_BYTES else "bfloat16"


def minus(gib: float | None, shared: float) -> float | None:
    """A measured peak less the shared base (None: not measured; inf: out of memory stays so)."""
    return None if gib is None else gib - shared


TrainerGib = Callable[[TrainConfig, bool], float]
"""The trainer's need in GiB for (train config, gradient checkpointing on)."""
TrainerPeak = Callable[[TrainConfig, bool], float | None]
"""The trainer's measured peak in GiB for (train config, gradient checkpointing on); None: not measured."""


def gpu_split(train: TrainConfig, infer: InferConfig, orch: OrchConfig, total_gib: float, *,
              model_config: Mapping[str, Any], kv_bytes_arg: bool, calibrate: bool,
              reserved_gib: float = 0.0,
              ) -> tuple[dict[str, Any], dict[str, Any], str]:
    """`split_updates` with the trainer's estimate (`tidal.models.memory.train_estimate`, total) and, with
    `calibrate`, its peak measured on the GPU before vLLM starts (`tidal.trainer.calibrate.measure_in_child`):
    what `tidal.colocate.derive.derive_colocate` calls on a GPU (`reserved_gib`: a teacher server's)."""
    def estimate(t: TrainConfig, ckpt: bool) -> float:
        return train_estimate(t, ckpt, model_config=model_config).total_gib

    def measure(t: TrainConfig, ckpt: bool) -> float | None:
        from tidal.trainer.calibrate import measure_in_child

        print(f"[tidal] GPU: measuring the trainer's peak memory before vLLM starts (one step of its largest "
              f"micro-batch, gradient checkpointing {'on' if ckpt else 'off'})", flush=True)
        return measure_in_child(t, ckpt)

    return split_updates(train, infer, orch, total_gib, model_config=model_config, kv_bytes_arg=kv_bytes_arg,
                         estimate_gib=estimate, measure_gib=measure if calibrate else None, reserved_gib=reserved_gib)


def split_updates(train: TrainConfig, infer: InferConfig, orch: OrchConfig, total_gib: float, *,
                  model_config: Mapping[str, Any], kv_bytes_arg: bool, estimate_gib: TrainerGib,
                  measure_gib: TrainerPeak | None = None, reserved_gib: float = 0.0
                  ) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(train updates, infer updates, notice) for `tidal grpo` on one GPU of `total_gib` (`plan_split` on the
    derived configs): infer `gpu_memory_utilization` (and `extra_args` `--kv-cache-memory-bytes` when
    `kv_bytes_arg`), train `gradient_checkpointing` when it was `auto`. `estimate_gib(train, ckpt)`: the trainer's
    estimate; `measure_gib(train, ckpt)`: its measured peak, None to use the estimate alone;
    `reserved_gib`: held by another process on the GPU (a teacher server: `tidal.colocate.teacher`). Pure
    arithmetic."""
    params = parameter_count(model_config)
    dtype = vllm_dtype(infer, model_config)
    # train share_base_weights on (`tidal.colocate.sharing.apply_sharing` ran first): the trainer's frozen
    # base is vLLM's tensors, counted once, in vLLM's share; the calibration step loads its own copy, so both the
    # estimate and the measured peak drop it
    shared = shared_bytes(model_config, dtype) / GIB if train.share_base_weights is True else 0.0
    sequences = sequences_in_flight(orch, max_num_seqs(infer, total_gib), servers=infer.dp)
    lora = (lora_slot_bytes(model_config, dtype, infer.max_loras, round_lora_rank(infer.max_lora_rank),
                            infer.lora_target_modules) if infer.enable_lora else 0)
    need = vllm_need(model_config, dtype, sequences, orch.seq_len, params, tp=infer.tp,
                     kv_dtype=infer.kv_cache_dtype, lora=lora)
    if infer.max_model_len:  # vLLM refuses to start when its cache cannot hold one request of max_model_len
        one = kv_need_bytes(model_config, dtype if infer.kv_cache_dtype == "auto" else infer.kv_cache_dtype, 1,
                            infer.max_model_len) // infer.tp
        need = replace(need, kv_cache=max(need.kv_cache, one))
    split = plan_split(total_gib, need, sequences=sequences, seq_len=orch.seq_len, kv_bytes_arg=kv_bytes_arg,
                       checkpointing=train.gradient_checkpointing,
                       estimate_gib=lambda ckpt: estimate_gib(train, ckpt) - shared,
                       measure_gib=(lambda ckpt: minus(measure_gib(train, ckpt), shared))
                       if measure_gib is not None else None, reserved_gib=reserved_gib)
    infer_updates: dict[str, Any] = {"gpu_memory_utilization": split.gpu_memory_utilization}
    if infer.max_model_len is None:  # the KV cache holds sequences of seq_len: vLLM 0.24 refuses to start when it
        infer_updates["max_model_len"] = orch.seq_len  # cannot hold one of the model's full context length
    if split.kv_cache_memory_bytes is not None and not any(a.startswith("--kv-cache-memory-bytes")
                                                           for a in infer.extra_args):
        infer_updates["extra_args"] = [*infer.extra_args, "--kv-cache-memory-bytes", str(split.kv_cache_memory_bytes)]
    train_updates = ({"gradient_checkpointing": split.gradient_checkpointing}
                     if train.gradient_checkpointing == "auto" else {})
    return train_updates, infer_updates, split.notice()


def explicit_share(train: TrainConfig, infer: InferConfig, orch: OrchConfig, total_gib: float, *,
                   model_config: Mapping[str, Any], estimate_gib: TrainerGib, reserved_gib: float = 0.0) -> str:
    """infer `gpu_memory_utilization` set by hand (no split): refused (`ConfigError`) when vLLM's share cannot
    hold its weights, LoRA slots and profile peak plus one sequence of infer `max_model_len` (else orch
    `seq_len`), which vLLM itself would refuse only after loading the model; otherwise a notice saying what the
    share leaves the trainer, and that a CUDA out-of-memory error is to be expected when its estimate is above
    that (the user chose the share: tidal does not override it). `estimate_gib(train, ckpt)`: the trainer's
    estimate."""
    dtype = vllm_dtype(infer, model_config)
    lora = (lora_slot_bytes(model_config, dtype, infer.max_loras, round_lora_rank(infer.max_lora_rank),
                            infer.lora_target_modules) if infer.enable_lora else 0)
    length = infer.max_model_len or orch.seq_len
    one = vllm_need(model_config, dtype, 1, length, parameter_count(model_config), tp=infer.tp,
                    kv_dtype=infer.kv_cache_dtype, lora=lora)
    util = infer.gpu_memory_utilization
    share = util * total_gib
    if one.budget / GIB > share:
        raise ConfigError(
            f"infer gpu_memory_utilization {util} gives vLLM {share:.1f} GiB of this {total_gib:.1f} GiB GPU, but "
            f"its weights ({one.weights / GIB:.1f} GiB), LoRA slots ({one.lora / GIB:.1f}), profile peak "
            f"({one.profile / GIB:.1f}) and the KV cache of one {length}-token sequence (infer max_model_len, else "
            f"orch seq_len: {one.kv_cache / GIB:.1f}) need {one.budget / GIB:.1f} GiB: vLLM would refuse to start; "
            f"raise infer gpu_memory_utilization to at least {math.ceil(one.budget / GIB / total_gib * 100) / 100}, "
            f"lower infer max_model_len / orch seq_len, or remove gpu_memory_utilization to let tidal split the GPU")
    ckpt = train.gradient_checkpointing is True
    trainer = estimate_gib(train, ckpt)
    room = total_gib - share - one.outside / GIB - reserved_gib
    note = (f"GPU ({total_gib:.1f} GiB): infer gpu_memory_utilization {util} set by hand (no split): vLLM holds "
            f"~{share + one.outside / GIB:.1f} GiB, leaving {room:.1f} GiB for the trainer, whose estimate is "
            f"{trainer:.1f} GiB (gradient checkpointing {'on' if ckpt else 'off or auto'})")
    if trainer > room:
        note += ("; expect CUDA to run out of memory in the trainer: lower gpu_memory_utilization or remove it to "
                 "let tidal split the GPU")
    return note
