"""Inference side of `weight_broadcast.type: nccl`: vLLM's weight-transfer engines, plus a gloo twin for CPU.

With `infer.weight_broadcast_type: nccl` tidal starts vLLM with `--weight-transfer-config` and its RL routes
(`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`); the
trainer opens rank 0 of a process group at `weight_broadcast.host:port` and broadcasts the new weights into
the workers (`tidal.trainer.publish.push_vllm`). On GPUs this is vLLM's own `nccl` engine. NCCL needs CUDA, so on
CPU-only machines the same protocol runs over gloo: `tidal_gloo` is vLLM's dense NCCL engine with the
communicator swapped for a torch gloo process group (same init/update payloads, same layerwise reload). It is
registered in every vLLM process by tidal's vLLM plugin (`tidal.inference.backends.vllm.plugin`, which also installs
tidal's runtime patches of vLLM) through `register_backend`.

The plugin runs in every vLLM start, also in runs that never push weights, so it must never break one: it
registers only what the installed vLLM supports. A vLLM without the weight-transfer modules the gloo engine builds
on (`vllm.distributed.weight_transfer.nccl_common`: vLLM 0.24.0 has none) gets nothing registered, and one line
in its log says so; asking such a vLLM for the push is refused before anything starts
(`tidal.inference.backends.vllm.support.check_weight_transfer`).
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch

GLOO_BACKEND = "tidal_gloo"
log = logging.getLogger("tidal.weight_transfer")


class GlooGroup:
    """A torch gloo process group over its own TCPStore (rank 0 hosts the store), outside torch.distributed's
    default group (vLLM's workers have their own). `broadcast` has the signature vLLM's engines call."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        listen_fd = None
        if rank == 0:  # listen on `host` only (TCPStore alone would listen on every interface), as vLLM does
            import socket

            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen()
            listen_fd = sock.detach()
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout,
                                   wait_for_workers=False, master_listen_fd=listen_fd, use_libuv=False)
        self.rank, self.world_size = rank, world_size
        self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: Any = None) -> None:
        self.pg.broadcast(tensor, src).wait()  # type: ignore[attr-defined]

    def destroy(self) -> None:
        self.pg = None  # type: ignore[assignment]
        self.store = None  # type: ignore[assignment]


def _engine_cls() -> type:
    from dataclasses import dataclass

    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    @dataclass(kw_only=True)
    class GlooInitInfo(NCCLWeightTransferInitInfo):  # type: ignore[misc, valid-type]
        timeout_s: float = 600.0
        """How long a worker waits in the rendezvous and in each broadcast (orch `weight_broadcast.timeout`)."""

    class GlooWeightTransferEngine(NCCLWeightTransferEngine):  # type: ignore[misc, valid-type]
        """vLLM's dense NCCL engine over a gloo group (CPU workers): unpacked, one tensor at a time."""

        init_info_cls = GlooInitInfo

        def init_transfer_engine(self, init_info: Any) -> None:
            pc = self.parallel_config
            rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
            self.packed = False
            self.model_update_group = GlooGroup(  # type: ignore[assignment]
                init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))  # no accelerator to synchronize

        def receive_weights(self, update_info: Any) -> None:
            if self.model_update_group is None:
                raise RuntimeError("gloo weight transfer not initialized: call /init_weight_transfer_engine first")
            for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes,
                                               strict=True):
                weight = torch.empty(shape, dtype=getattr(torch, dtype_name), device=self.device)
                self.model_update_group.broadcast(weight, src=0)
                self.model.load_weights([(name, weight)])  # type: ignore[operator]

    return GlooWeightTransferEngine


def register_backend() -> None:
    """Make `tidal_gloo` a vLLM weight-transfer backend (called by tidal's vLLM plugin,
    `tidal.inference.backends.vllm.plugin.register`, in every vLLM process). Idempotent. On a vLLM without weight
    transfer, or without the modules the engine builds on, it registers nothing (the vLLM still starts)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        if GLOO_BACKEND in WeightTransferEngineFactory._registry:
            return
        engine = _engine_cls()
        WeightTransferEngineFactory.register_engine(GLOO_BACKEND, engine)
    except (ImportError, AttributeError) as exc:  # another vLLM: its start must go on; the push is refused up front
        from tidal.inference.backends.vllm.support import vllm_version

        missing = exc.name if isinstance(exc, ImportError) and exc.name else repr(exc)
        log.info("tidal: vLLM %s lacks %s: the %s weight-transfer backend is not registered (weight_broadcast.type "
                 "nccl unavailable with this vLLM)", vllm_version(), missing, GLOO_BACKEND)


def transfer_backend(on_cpu: bool) -> str:
    """vLLM weight-transfer backend for `weight_broadcast_type: nccl` on this machine."""
    return GLOO_BACKEND if on_cpu else "nccl"
