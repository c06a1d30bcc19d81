"""Trainer side of `weight_broadcast.type: nccl` with SGLang servers (train `weight_broadcast.backend: sglang`).

A `tidal.trainer.publish.session.PushSession` like `tidal.trainer.publish.push_vllm.WeightPusher` (vLLM): the same
`tidal.trainer.publish.push.Pusher`. The trainer (rank 0) pushes the same tensors
(`tidal.trainer.publish.broadcast.policy_weights`, then any `extra`, e.g. QeRL's noisy norms) through SGLang 0.5.16's
routes (`sglang/srt/entrypoints/http_server.py`):

- opening: `POST /init_weights_update_group` {`master_address`, `master_port`, `rank_offset`, `world_size`,
  `group_name`, `backend: "nccl"`} on every server while rank 0 joins the same rendezvous with SGLang's own
  `init_custom_process_group` (`tcp://host:port`). Server i's `tp` workers take ranks `rank_offset + tp_rank`, its
  offset following the previous servers' `tp_size` (`/server_info`).
- per push: `POST /update_weights_from_distributed` {`names`, `dtypes`, `shapes`, `group_name`,
  `flush_cache: true`, `weight_version: str(step)`} on every server while rank 0 broadcasts each tensor in that
  order (`torch.distributed.broadcast(src=0)`). SGLang takes its model-update writer lock for the update, so
  in-flight requests finish on the old policy and new ones wait: every completion comes from one policy. The
  stamped version is what the orchestrator reads back from `/model_info` (`SglangClient.weight_versions`).
- a failed push drops the group (`/destroy_weights_update_group`); the next push opens a new one.

NCCL on CUDA only (SGLang serves on GPUs only here). Not run on a GPU yet (docs/sglang.md lists the commands).
"""

from __future__ import annotations

import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tidal.trainer.publish.broadcast import policy_weight_specs, policy_weights
from tidal.trainer.publish.session import ExtraTensors, PushSession

log = logging.getLogger("tidal.trainer")
GROUP = "tidal_weights"


def rank_offsets(tp_sizes: list[int]) -> tuple[list[int], int]:
    """Each server's first rank in the group (rank 0 is the trainer) and the group's size."""
    return [1 + sum(tp_sizes[:i]) for i in range(len(tp_sizes))], 1 + sum(tp_sizes)


def update_request(specs: list[tuple[str, torch.dtype, list[int]]], step: int) -> dict[str, Any]:
    """The `/update_weights_from_distributed` body announcing the tensors `specs` (name, dtype, shape), in the
    order rank 0 broadcasts them, as policy version `step`."""
    return {"names": [name for name, _, _ in specs],
            "dtypes": [str(dtype).removeprefix("torch.") for _, dtype, _ in specs],
            "shapes": [list(shape) for _, _, shape in specs], "group_name": GROUP, "flush_cache": True,
            "weight_version": str(step)}


class SglangWeightPusher(PushSession):
    """Broadcasts policies into the SGLang servers at `urls` (their `/v1` base URLs)."""

    def __init__(self, urls: list[str], host: str, port: int, timeout_s: float, api_key: str | None,
                 device: torch.device, extra: ExtraTensors | None = None) -> None:
        if device.type != "cuda":
            raise ValueError("weight_broadcast type nccl with backend sglang needs the trainer on a CUDA GPU "
                             "(SGLang serves on GPUs only); use weight_broadcast.type: filesystem")
        super().__init__(urls, host, port, timeout_s, api_key, device, extra)

    def _post(self, root: str, path: str, payload: dict[str, Any]) -> Any:
        r = self.http.post(f"{root}/{path}", json=payload)
        if r.status_code != 200:
            raise RuntimeError(f"{root}/{path} answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def _tp_sizes(self) -> list[int]:
        sizes = []
        for root in self.roots:
            r = self.http.get(f"{root}/server_info")
            if r.status_code != 200:
                raise RuntimeError(f"{root}/server_info answered {r.status_code}: {r.text[:300]}")
            sizes.append(int(r.json()["tp_size"]))
        return sizes

    def _open(self) -> None:
        """Open the process group: rank 0 here, each server's workers after the previous server's."""
        from sglang.srt.utils import init_custom_process_group  # the servers join through the same function

        offsets, world = rank_offsets(self._tp_sizes())
        ex = ThreadPoolExecutor(len(self.roots))  # the workers join inside /init_weights_update_group
        try:
            futures = [ex.submit(self._post, r, "init_weights_update_group",
                                 {"master_address": self.host, "master_port": self.port, "rank_offset": off,
                                  "world_size": world, "group_name": GROUP, "backend": "nccl"})
                       for r, off in zip(self.roots, offsets, strict=True)]
            self.group = init_custom_process_group(backend="nccl", init_method=f"tcp://{self.host}:{self.port}",
                                                   world_size=world, rank=0, group_name=GROUP)
            for f in futures:
                f.result()
        finally:
            ex.shutdown(wait=False)
        log.info("weight broadcast group open at %s:%d (nccl, %d SGLang workers on %d servers)", self.host,
                 self.port, world - 1, len(self.roots))

    def close(self) -> None:
        if self.group is None:
            return
        for root in self.roots:
            try:
                self._post(root, "destroy_weights_update_group", {"group_name": GROUP})
            except Exception as exc:  # noqa: BLE001
                log.warning("could not close the weight group on %s: %r", root, exc)
        torch.distributed.destroy_process_group(self.group)
        self.group = None

    def _transfer(self, model: torch.nn.Module, step: int) -> None:
        extra = self.extra(model, step) if self.extra is not None else {}
        specs = policy_weight_specs(model) + [(k, t.dtype, list(t.shape)) for k, t in extra.items()]
        update = update_request(specs, step)
        ex = ThreadPoolExecutor(len(self.roots))
        try:
            futures = [ex.submit(self._post, r, "update_weights_from_distributed", update) for r in self.roots]
            with torch.no_grad():
                for _name, w in itertools.chain(policy_weights(model), extra.items()):  # merged one at a time
                    torch.distributed.broadcast(w.to(self.device).contiguous(), src=0, group=self.group)
            torch.cuda.current_stream().synchronize()
            for f in futures:
                f.result()
        finally:
            ex.shutdown(wait=False)  # after a failed broadcast a worker may sit in a collective: do not wait
