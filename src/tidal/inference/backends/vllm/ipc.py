"""CUDA IPC handles of tensors as JSON (no pickle): what vLLM's worker sends and the trainer opens.

`torch.multiprocessing.reductions.reduce_tensor` turns a CUDA tensor into `(rebuild_cuda_tensor, args)`; the
args are plain values (sizes, strides, offsets, the dtype, the device index, the CUDA IPC memory handle and the
producer's ref-counter and event handles as bytes). `encode` writes them as a JSON object (bytes in base64, the
dtype by name, the two classes from a fixed list) and `decode` calls `rebuild_cuda_tensor` with them, on the
trainer's device index: the handle names a GPU allocation, which the trainer maps without a copy. The producer
(vLLM) must stay alive while the trainer uses the tensors. A CPU tensor has no IPC handle and is refused.
"""

from __future__ import annotations

import base64
from typing import Any

import torch

FORMAT = 1
"""Version of the JSON layout (a trainer refuses handles of another version)."""

STORAGE_CLASSES = {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.UntypedStorage}
TENSOR_CLASSES = {"Tensor": torch.Tensor, "Parameter": torch.nn.Parameter}


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def encode(tensor: torch.Tensor) -> dict[str, Any]:
    """The CUDA IPC handle of `tensor` (a CUDA tensor) as a JSON-serializable dict (`FORMAT`)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    if tensor.device.type != "cuda":
        raise ValueError(f"CUDA IPC handles exist for CUDA tensors only (got a {tensor.device.type} tensor)")
    rebuild, args = reduce_tensor(tensor.detach())
    if rebuild is not rebuild_cuda_tensor:
        raise ValueError(f"torch reduced the tensor with {getattr(rebuild, '__name__', rebuild)}, not "
                         f"rebuild_cuda_tensor (a layout CUDA IPC cannot share)")
    (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, storage_bytes, storage_offset,
     requires_grad, ref_handle, ref_offset, event_handle, event_sync) = args
    return {"format": FORMAT, "tensor_cls": tensor_cls.__name__, "size": list(size), "stride": list(stride),
            "offset": int(offset), "storage_cls": storage_cls.__name__, "dtype": str(dtype).removeprefix("torch."),
            "device": int(device), "handle": _b64(handle), "storage_size_bytes": int(storage_bytes),
            "storage_offset_bytes": int(storage_offset), "requires_grad": bool(requires_grad),
            "ref_counter_handle": _b64(ref_handle), "ref_counter_offset": int(ref_offset),
            "event_handle": _b64(event_handle), "event_sync_required": bool(event_sync)}


def rebuild_args(entry: dict[str, Any], device_index: int) -> tuple[Any, ...]:
    """The arguments of `rebuild_cuda_tensor` for an `encode`d handle, opened on `device_index` (this process's
    index of the same GPU). Raises `ValueError` for another format or an unknown class/dtype."""
    if entry.get("format") != FORMAT:
        raise ValueError(f"CUDA IPC handle format {entry.get('format')!r}; this tidal reads format {FORMAT}")
    dtype = getattr(torch, entry["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"CUDA IPC handle: unknown dtype {entry['dtype']!r}")
    try:
        tensor_cls, storage_cls = TENSOR_CLASSES[entry["tensor_cls"]], STORAGE_CLASSES[entry["storage_cls"]]
    except KeyError as exc:
        raise ValueError(f"CUDA IPC handle: class {exc.args[0]!r} is not one tidal rebuilds") from None
    return (tensor_cls, torch.Size(entry["size"]), tuple(entry["stride"]), entry["offset"], storage_cls, dtype,
            device_index, _unb64(entry["handle"]), entry["storage_size_bytes"], entry["storage_offset_bytes"],
            False, _unb64(entry["ref_counter_handle"]), entry["ref_counter_offset"], _unb64(entry["event_handle"]),
            entry["event_sync_required"])


def decode(entry: dict[str, Any], device_index: int) -> torch.Tensor:
    """The tensor an `encode`d handle names, mapped into this process on GPU `device_index` (no copy)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(*rebuild_args(entry, device_index))  # type: ignore[no-any-return]


def device_uuid(index: int) -> str:
    """The UUID of CUDA device `index` as this process numbers it (CUDA_VISIBLE_DEVICES may renumber GPUs, the
    UUID names the physical one)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def local_index(uuid: str) -> int | None:
    """This process's index of the GPU with `uuid`, or None when it does not see that GPU."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    return None
