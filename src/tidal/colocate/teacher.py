"""The teacher server of on-policy distillation in `tidal grpo` (docs/algorithms.md, "On-policy distillation").

When orch `teacher.base_url` is null, `tidal grpo` serves orch `teacher.model` itself: one more `tidal grpo-infer`
child, started beside the policy's server, supervised like it (restarted when it dies; the orchestrator retries
the step once both answer: `tidal.colocate.supervise.run_colocate`) and stopped with the run. With an address the
user runs the teacher (three-process mode) and nothing here applies. The derivation, pure:

- `teacher_infer`: the teacher's infer config from the policy's derived one: model `teacher.model`, the same
  host, the port after the policy's servers (infer `port + dp`), no LoRA (nothing is ever loaded into it), no
  weight reloads or pushes, one server (dp 1, tp 1), and the policy server's dtype, `max_model_len` (orch
  `seq_len` when unset), KV-cache dtype, CPU KV-cache size, `log_stats` and seed.
- CPU: the teacher's OpenMP threads share vLLM's cores (`VLLM_CPU_OMP_THREADS_BIND`, the placement's), the
  trainer keeps its own.
- GPU: the teacher shares the one GPU with the policy's vLLM and the trainer. Its need (`teacher_need`: weights,
  profile, the full-vocabulary prompt logprobs of a step, KV cache for `teacher.max_concurrency` sequences of
  `seq_len`, and what vLLM holds outside its share) is reserved before the policy/trainer split
  (`tidal.colocate.derive.derive_colocate` hands `reserved_gib` to `tidal.colocate.split.gpu_split`), and
  becomes the teacher's
  `gpu_memory_utilization` (and `--kv-cache-memory-bytes` where vLLM has it). Several GPUs (train `gpus` or infer
  dp x tp above 1) are refused: run the teacher yourself and give its address (`tidal.colocate.derive.with_teacher`
  places it and points the orchestrator at it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from tidal.colocate.split import GIB, VllmNeed, max_num_seqs, vllm_dtype, vllm_need
from tidal.config.infer import InferConfig
from tidal.config.orch import OrchConfig
from tidal.models.config import text_config
from tidal.models.memory import parameter_count

LOGPROB_BYTES = 4
"""vLLM computes prompt logprobs over the whole vocabulary in float32."""

@dataclass(frozen=True)
class TeacherServer:
    """The teacher server `tidal grpo` runs (derived; not part of any config file)."""

    infer: InferConfig
    """Its `tidal grpo-infer` config (written to `configs/teacher.yaml`)."""
    base_url: str
    """Where the orchestrator reaches it (`.../v1`), set as orch `teacher.base_url`."""
    health_url: str
    """Its health endpoint, polled before the orchestrator and trainer start."""
    env: Mapping[str, str]
    """Environment variables added to its process (its CPU cores)."""
    notices: tuple[str, ...]
    """Lines to tell the user before starting."""


def serves_teacher(orch: OrchConfig) -> bool:
    """`tidal grpo` starts the teacher: orch `teacher` is set without an address."""
    return orch.teacher is not None and orch.teacher.base_url is None


def teacher_infer(infer: InferConfig, orch: OrchConfig) -> InferConfig:
    """The teacher server's infer config, from the policy server's (derived) one (module doc)."""
    assert orch.teacher is not None
    return InferConfig(backend=infer.backend, model=orch.teacher.model, host=infer.host, port=infer.port + infer.dp,
                       dtype=infer.dtype, max_model_len=infer.max_model_len or orch.seq_len, enable_lora=False,
                       log_stats=infer.log_stats, cpu_kvcache_space_gib=infer.cpu_kvcache_space_gib,
                       kv_cache_dtype=infer.kv_cache_dtype, seed=infer.seed)


def teacher_need(teacher: InferConfig, orch: OrchConfig, total_gib: float, *, model_config: Mapping[str, Any],
                 params: int | None = None) -> VllmNeed:
    """What the teacher server holds on a GPU of `total_gib`: `vllm_need` for `teacher.max_concurrency` sequences
    of `seq_len` (its requests in flight), plus the float32 prompt logprobs over the vocabulary of one step's
    tokens (at most `max_concurrency x seq_len`) in its profile. `params`: the model's parameter count (default:
    counted from `model_config`)."""
    assert orch.teacher is not None
    params = parameter_count(model_config) if params is None else params
    text = text_config(model_config)
    sequences = min(orch.teacher.max_concurrency, max_num_seqs(teacher, total_gib))
    need = vllm_need(model_config, vllm_dtype(teacher, model_config), sequences, orch.seq_len, params,
                     kv_dtype=teacher.kv_cache_dtype)
    logprobs = sequences * orch.seq_len * int(text["vocab_size"]) * LOGPROB_BYTES
    return replace(need, profile=need.profile + logprobs)


def share(need: VllmNeed, total_gib: float) -> float:
    """The `gpu_memory_utilization` holding `need`'s budget (rounded up to 0.01, as the policy server's)."""
    return math.ceil(need.budget / GIB / total_gib * 100) / 100


def reserved_gib(need: VllmNeed, total_gib: float) -> float:
    """GiB the teacher server holds on the GPU: its share plus what vLLM holds beyond it."""
    return share(need, total_gib) * total_gib + need.outside / GIB


def notice(need: VllmNeed, total_gib: float) -> str:
    return (f"teacher vLLM {reserved_gib(need, total_gib):.1f} GiB (gpu_memory_utilization {share(need, total_gib)}: "
            f"weights {need.weights / GIB:.1f}, KV cache {need.kv_cache / GIB:.1f}, CUDA graphs + context "
            f"{need.outside / GIB:.1f}), reserved before the split")
