"""Nested training state (an optimizer's `state_dict`, RNG states) as JSON + safetensors, never pickle.

`to_tree` splits a state into a JSON tree whose tensors (torch or numpy) are referenced by name and collected
into one dict, which `save_state` stores as `{name}.safetensors` beside `{name}.json` (tensors sharing memory, such
as the quantization maps of an 8-bit optimizer, are stored as separate copies); `load_state` and `from_tree` invert
it. Used by the trainer's checkpoints (`tidal.trainer.ckpt`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tidal.checkpoint import CheckpointError

TENSOR, TUPLE, ITEMS = "__tensor__", "__tuple__", "__items__"


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
    save_file(unshared(tensors), str(directory / f"{name}.safetensors"), metadata={"format": "pt"})
    (directory / f"{name}.json").write_text(json.dumps(tree))


def unshared(tensors: dict[str, Any]) -> dict[str, Any]:
    """`tensors` with every tensor whose memory an earlier one already uses replaced by a copy: safetensors
    refuses shared memory, and optimizer states share tensors (bitsandbytes' 8-bit AdamW gives every parameter
    the same quantization maps `qmap1`/`qmap2`). Each copy loads back as its own tensor with the same values."""
    seen: set[int] = set()
    out = {}
    for key, t in tensors.items():
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
        out[key] = t.clone() if ptr and ptr in seen else t
        seen.add(ptr)
    return out


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
