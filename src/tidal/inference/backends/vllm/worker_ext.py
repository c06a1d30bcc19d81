"""vLLM worker extension: hand a co-located trainer CUDA IPC handles of the served base weights, and merge a LoRA
policy's factors into the served weights (`tidal.inference.backends.vllm.lora_merge`, orch `weight_broadcast.reload:
factors`).

vLLM mixes the class named by `--worker-extension-cls` into its GPU worker (vLLM 0.24 and 0.32:
`ParallelConfig.worker_extension_cls`), so its methods run in the worker process that holds the model and can be
called through `collective_rpc`; tidal calls `tidal_export_base` over the dev-mode HTTP route
(`POST /collective_rpc {"method": "tidal_export_base"}`, infer `export_base_weights`), which returns each
worker's dict as JSON. The dict holds, per parameter of the served model (`named_parameters`, names as vLLM has
them, LoRA `base_layer` levels included), its `tidal.inference.backends.vllm.ipc` handle, plus the GPU's UUID, so the
trainer opens the handles on the same physical GPU whatever its device numbering. Nothing is copied; the worker keeps
owning the memory. `tidal.inference.backends.vllm.server` starts vLLM with `TidalWorkerExtension` (both) whenever it
opens the dev routes for the extension's callers: infer `export_base_weights: true` or `weight_reload: true`.
"""

from __future__ import annotations

import os
from typing import Any

from tidal.inference.backends.vllm.ipc import FORMAT, device_uuid, encode
from tidal.inference.backends.vllm.lora_merge import LoraMergeExtension


class SharedWeightsExtension:
    """Mixed into vLLM's worker (`self.model_runner` is the worker's); methods prefixed `tidal_` so that they
    cannot clash with the worker's own attributes (vLLM checks)."""

    model_runner: Any

    def _tidal_params(self) -> dict[str, Any]:
        runner = self.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        return dict(model.named_parameters())

    def tidal_base_layout(self) -> dict[str, Any]:
        """{"device", "tensors": {vLLM parameter name: {"shape", "dtype"}}} of this worker's model, as it is after
        loading (on CPU, vLLM's GEMM prepack leaves linear weights empty): what `view_plan` needs, any device."""
        params = self._tidal_params()
        first = next(iter(params.values()), None)
        return {"device": str(first.device) if first is not None else None,
                "tensors": {n: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
                            for n, p in params.items()}}

    def tidal_export_base(self) -> dict[str, Any]:
        """{"format", "gpu_uuid", "pid", "tensors": {vLLM parameter name: CUDA IPC handle}} of this worker's
        model (tied parameters once)."""
        params = self._tidal_params()
        if not params:
            raise RuntimeError("tidal_export_base: the served model has no parameters")
        first = next(iter(params.values()))
        if first.device.type != "cuda":
            raise RuntimeError(f"tidal_export_base: the served weights are on {first.device}, not a CUDA device "
                               f"(CUDA IPC only)")
        index = first.device.index if first.device.index is not None else 0
        return {"format": FORMAT, "gpu_uuid": device_uuid(index), "pid": os.getpid(),
                "tensors": {name: encode(p) for name, p in params.items()}}


class TidalWorkerExtension(SharedWeightsExtension, LoraMergeExtension):
    """tidal's `--worker-extension-cls`: the base-weight export (`tidal_export_base`, `tidal_base_layout`) and the
    in-worker LoRA merge (`tidal_merge_lora`)."""
