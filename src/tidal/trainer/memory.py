"""The trainer's memory while it runs: its peak (`reset_peak`, `peak_gib`: CUDA's allocator, or the peak RSS on CPU),
train `gradient_checkpointing: auto` outside `tidal grpo` (`resolve_checkpointing`), and what a CUDA out-of-memory
error turns into (`exits_on_oom`, `oom_message`). The estimate these compare against is torch-free and lives in
`tidal.models.memory`; the calibration step that measures it before vLLM starts, in `tidal.trainer.calibrate`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from tidal.models.memory import GIB, checkpointing_needed, train_estimate, train_footprint_gib


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


def resolve_checkpointing(train: Any, device: Any) -> bool:
    """Whether the trainer checkpoints activations: train `gradient_checkpointing` when true/false; `auto` is off
    on CPU (as the default always was there: no recomputation, the same speed) and on CUDA on when the estimate
    without it exceeds the GPU memory free at load time (`checkpointing_needed`; `tidal grpo` writes an explicit
    value, decided by its memory split)."""
    if train.gradient_checkpointing != "auto":
        return bool(train.gradient_checkpointing)
    if getattr(device, "type", str(device)) != "cuda":
        return False
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    try:
        need = train_estimate(train, gradient_checkpointing=False).total_gib
    except (OSError, ValueError, KeyError):
        return True  # no estimate: the safe side
    return checkpointing_needed(need, free / GIB)


def oom_message(peak_gib: float, estimate_gib: float | None, total_gib: float | None, checkpointing: bool) -> str:
    """What the trainer says when CUDA runs out of memory: the measured peak, the estimate vLLM's share was sized
    with, and the keys that lower the trainer's need or vLLM's share."""
    est = f"{estimate_gib:.2f} GiB" if estimate_gib is not None else "none (no config.json)"
    gpu = f" of the {total_gib:.1f} GiB GPU" if total_gib else ""
    keys = ["train per_device_train_batch_size (or micro_batch_tokens)", "train sequence_len / orch seq_len"]
    if not checkpointing:
        keys.insert(0, "train gradient_checkpointing: true")
    keys += ["train logprob_chunk_size (smaller)", "infer gpu_memory_utilization (lower: vLLM shares this GPU)"]
    return (f"CUDA out of memory in the trainer: measured peak {peak_gib:.2f} GiB allocated{gpu}, estimate {est}; "
            f"lower the trainer's need or vLLM's share: {'; '.join(keys)}")


class TrainerOutOfMemory(RuntimeError):
    """CUDA ran out of memory in the trainer; the message says what was measured and what to change."""


@contextlib.contextmanager
def exits_on_oom(train: Any) -> Iterator[None]:
    """Turn a CUDA out-of-memory error inside the block into `TrainerOutOfMemory` with `oom_message` (`tidal
    grpo-train` logs it and exits 1; `tidal grpo`'s launcher then stops vLLM and the orchestrator as for any
    failed component, so nothing is left on the GPU)."""
    import torch

    try:
        yield
    except torch.OutOfMemoryError as exc:
        cuda = torch.cuda.is_available()
        peak = torch.cuda.max_memory_allocated() / GIB if cuda else 0.0
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB if cuda else None
        try:
            est: float | None = train_footprint_gib(train)
        except (OSError, ValueError, KeyError):
            est = None
        raise TrainerOutOfMemory(oom_message(peak, est, total, train.gradient_checkpointing is True)) from exc
