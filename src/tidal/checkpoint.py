"""Checkpoint directories shared by trainer and orchestrator: atomic writes, discovery, pruning, state trees.

A checkpoint is `{run_dir}/checkpoints/{component}/step_{n}/` holding safetensors files (tensors) and JSON
files (everything else), plus a `STABLE` marker written last. It is assembled in a temp directory that is
renamed into place, so a crash (or a full disk) at any point leaves either the previous checkpoints alone or a
complete new one; a temp directory left by a crash is removed by the next write. Nothing is pickled: nested
state (an optimizer's `state_dict`, RNG states) is split by `to_tree` into a JSON tree whose tensors are
referenced by name and stored in one safetensors file.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

TENSOR, TUPLE, ITEMS = "__tensor__", "__tuple__", "__items__"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file."""


def ckpt_root(run_dir: Path, component: str) -> Path:
    return run_dir / "checkpoints" / component


def ckpt_dir(run_dir: Path, component: str, step: int) -> Path:
    return ckpt_root(run_dir, component) / f"step_{step}"


def complete_steps(run_dir: Path, component: str) -> list[int]:
    """Steps with a complete (STABLE) checkpoint, ascending."""
    root = ckpt_root(run_dir, component)
    steps = [int(d.name[5:]) for d in root.glob("step_*") if d.name[5:].isdigit() and (d / "STABLE").is_file()]
    return sorted(steps) if root.is_dir() else []


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


def write_checkpoint(run_dir: Path, component: str, step: int, fill: Callable[[Path], None]) -> Path:
    """Create checkpoint `step` atomically: `fill(tmp_dir)` writes the files, then rename + STABLE.
    On any OSError (disk full, quota, permissions) the temp directory is removed and CheckpointError names
    the checkpoint; earlier checkpoints are untouched."""
    final = ckpt_dir(run_dir, component, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(".step_*.tmp.*"):  # left by a crashed writer
        shutil.rmtree(stale, ignore_errors=True)
    tmp = final.with_name(f".{final.name}.tmp.{os.getpid()}")
    try:
        tmp.mkdir()
        fill(tmp)
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as h:
                    os.fsync(h.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        marker = final / ".STABLE.tmp"
        marker.write_text(str(step))
        os.replace(marker, final / "STABLE")
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (isinstance(exc, OSError) or "I/O error" in str(exc)):  # safetensors wraps OSError in its own
            raise
        full = (getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
                or any(f"os error {n})" in str(exc) for n in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)))
        why = "the disk is full" if full else "an I/O error"
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


def to_tree(obj: Any, tensors: dict[str, Any], path: str = "t") -> Any:
    """JSON-able tree of `obj`; tensors go to `tensors` under their path and are referenced by it."""
    import numpy as np
    import torch

    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().cpu().contiguous()
        return {TENSOR: path}
    if isinstance(obj, np.ndarray):
        tensors[path] = torch.from_numpy(np.ascontiguousarray(obj))
        return {TENSOR: path, "numpy": True}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: to_tree(v, tensors, f"{path}.{k}") for k, v in obj.items()}
        return {ITEMS: [[k, to_tree(v, tensors, f"{path}.{i}")] for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, tuple):
        return {TUPLE: [to_tree(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [to_tree(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"cannot checkpoint a {type(obj).__name__} at {path} (tensors, numbers, strings, lists, "
                    f"tuples and dicts only)")


def from_tree(tree: Any, tensors: dict[str, Any]) -> Any:
    """Inverse of `to_tree`."""
    if isinstance(tree, dict):
        if TENSOR in tree:
            t = tensors[tree[TENSOR]]
            return t.numpy() if tree.get("numpy") else t
        if TUPLE in tree:
            return tuple(from_tree(v, tensors) for v in tree[TUPLE])
        if ITEMS in tree:
            return {k: from_tree(v, tensors) for k, v in tree[ITEMS]}
        return {k: from_tree(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [from_tree(v, tensors) for v in tree]
    return tree


def save_state(directory: Path, name: str, state: dict[str, Any]) -> None:
    """`{name}.json` + `{name}.safetensors` for a nested state (see `to_tree`)."""
    from safetensors.torch import save_file

    tensors: dict[str, Any] = {}
    tree = to_tree(state, tensors)
    save_file(tensors, str(directory / f"{name}.safetensors"), metadata={"format": "pt"})
    (directory / f"{name}.json").write_text(json.dumps(tree))


def load_state(directory: Path, name: str) -> dict[str, Any]:
    """Read a state written by `save_state`; CheckpointError names the file when it is missing or corrupt."""
    from safetensors.torch import load_file

    for suffix in ("json", "safetensors"):
        if not (directory / f"{name}.{suffix}").is_file():
            raise CheckpointError(f"checkpoint file {directory / f'{name}.{suffix}'} is missing")
    try:
        tensors = load_file(str(directory / f"{name}.safetensors"))
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for a damaged file
        raise CheckpointError(f"checkpoint file {directory / f'{name}.safetensors'} is corrupt: {exc}") from exc
    try:
        tree = json.loads((directory / f"{name}.json").read_text())
        return dict(from_tree(tree, tensors))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint file {directory / f'{name}.json'} is corrupt: {exc!r}") from exc
