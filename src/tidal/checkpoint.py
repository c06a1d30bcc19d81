"""Checkpoint directories shared by trainer and orchestrator: atomic writes, discovery, pruning.

A checkpoint is `{run_dir}/checkpoints/{component}/step_{n}/` holding safetensors files (tensors) and JSON
files (everything else), plus a `STABLE` marker written last (`tidal.paths.atomic_dir`: filled in a temp
directory, fsynced, renamed into place), so a crash (or a full disk) at any point leaves either the previous
checkpoints alone or a complete new one; a temp directory left by a crash is removed by the next write.
Nothing is pickled (the trainer's nested tensor state: `tidal.trainer.state`). Torch-free: the orchestrator
uses this module too.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from pathlib import Path

from tidal.paths import atomic_dir, ckpt_dir, ckpt_root, stable_steps

TRAINER = "trainer"
"""The trainer's checkpoints (`checkpoints/trainer/`): a run with one can be resumed (`tidal grpo --resume`)."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file."""


def complete_steps(run_dir: Path, component: str) -> list[int]:
    """Steps with a complete (STABLE) checkpoint, ascending."""
    return stable_steps(ckpt_root(run_dir, component))


def resolve_resume_step(run_dir: Path, component: str, resume_step: int | None) -> int | None:
    """The checkpoint step to resume from: `resume_step` itself, or the newest complete one for -1 (None when
    there is none). Raises CheckpointError when a requested step has no complete checkpoint."""
    if resume_step is None:
        return None
    steps = complete_steps(run_dir, component)
    if resume_step == -1:
        return steps[-1] if steps else None
    if resume_step not in steps:
        have = ", ".join(map(str, steps)) or "none"
        raise CheckpointError(f"ckpt.resume_step {resume_step}: no complete {component} checkpoint "
                              f"{ckpt_dir(run_dir, component, resume_step)} (complete steps: {have})")
    return resume_step


def _disk_full(exc: BaseException) -> bool:
    codes = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    return getattr(exc, "errno", None) in codes or any(f"os error {n})" in str(exc) for n in codes)


def write_checkpoint(run_dir: Path, component: str, step: int, fill: Callable[[Path], None]) -> Path:
    """Create checkpoint `step` atomically: `fill(tmp_dir)` writes the files (see `tidal.paths.atomic_dir`).
    On any OSError (disk full, quota, permissions) CheckpointError names the checkpoint; no partial checkpoint
    is left and earlier checkpoints are untouched."""
    final = ckpt_dir(run_dir, component, step)
    try:
        with atomic_dir(final, marker=str(step)) as tmp:
            fill(tmp)
    except BaseException as exc:
        if not (isinstance(exc, OSError) or "I/O error" in str(exc)):  # safetensors wraps OSError in its own
            raise
        why = "the disk is full" if _disk_full(exc) else "an I/O error"
        raise CheckpointError(f"could not write {component} checkpoint {final}: {why} ({exc}); no partial "
                              f"checkpoint was left and earlier checkpoints are intact") from exc
    return final


def prune_checkpoints(run_dir: Path, component: str, keep_last: int | None, keep_interval: int | None) -> list[int]:
    """Delete complete checkpoints beyond the newest `keep_last`, except steps that are multiples of
    `keep_interval` (kept for good). No `keep_last`: keep everything. Returns the deleted steps."""
    if keep_last is None:
        return []
    steps = complete_steps(run_dir, component)
    doomed = [s for s in steps[:-keep_last] if not (keep_interval and s % keep_interval == 0)]
    for s in doomed:
        shutil.rmtree(ckpt_dir(run_dir, component, s), ignore_errors=True)
    return doomed
