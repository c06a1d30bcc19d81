"""Trainer side of `weight_broadcast.type: nccl`: push the new policy straight into the inference workers.

After each optimizer step the trainer (rank 0) broadcasts the merged weights of every LoRA-adapted module
(W + scale * B A, under the base checkpoint's names; nothing else changed), or with full fine-tuning every
weight (`broadcast.policy_weights`), plus any `extra` tensors (QeRL: every RMSNorm weight with policy n's
noise, `tidal.trainer.model.noise.noisy_norms`), into vLLM's workers through
vLLM's weight-transfer engine and its RL routes, then stamps the servers with the step as their
`weight_version`. Per push, on every server: `/pause?mode=wait` (in-flight requests finish on the old
policy, new ones queue, caches are dropped), `/start_weight_update`, `/update_weights` (the workers join the
broadcast), `/finish_weight_update` with the step, `/resume`: every completion comes from one policy.

The process group (trainer + all workers of all servers, each server's workers at its own rank offset) is
opened at the first push with `/init_weight_transfer_engine` and kept; NCCL on CUDA, gloo on CPU
(`tidal.inference.backends.vllm.weight_transfer`). A push that fails (a server died) drops the group; the next push, or
an orchestrator's re-push request (`tidal.transport.weights.request_push`, written when a restarted server is
behind), opens a new one (`tidal.trainer.publish.session.PushSession`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tidal.trainer.publish.broadcast import policy_weight_specs, policy_weights
from tidal.trainer.publish.session import ExtraTensors, PushSession

log = logging.getLogger("tidal.trainer")


class WeightPusher(PushSession):
    """Broadcasts policies into the vLLM servers at `urls` (their `/v1` base URLs)."""

    def __init__(self, urls: list[str], host: str, port: int, timeout_s: float, api_key: str | None,
                 device: torch.device, extra: ExtraTensors | None = None) -> None:
        super().__init__(urls, host, port, timeout_s, api_key, device, extra)
        self.cuda = device.type == "cuda"

    def _post(self, root: str, path: str, payload: dict[str, Any] | None = None,
              params: dict[str, str] | None = None) -> Any:
        r = self.http.post(f"{root}/{path}", json=payload, params=params)
        if r.status_code != 200:
            raise RuntimeError(f"{root}/{path} answered {r.status_code}: {r.text[:300]}")
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else None

    def _each(self, path: str, payload: dict[str, Any] | None = None,
              params: dict[str, str] | None = None) -> list[Any]:
        with ThreadPoolExecutor(len(self.roots)) as ex:
            return list(ex.map(lambda r: self._post(r, path, payload, params), self.roots))

    def _open(self) -> None:
        """Open the process group: rank 0 here, each server's workers after the previous server's."""
        workers = [len(self._post(r, "collective_rpc", {"method": "check_health"})["results"]) for r in self.roots]
        world = 1 + sum(workers)
        infos, offset = [], 1
        for n in workers:
            info: dict[str, Any] = {"master_address": self.host, "master_port": self.port, "rank_offset": offset,
                                    "world_size": world, "packed": self.cuda}
            if not self.cuda:
                info["timeout_s"] = self.timeout_s
            infos.append(info)
            offset += n
        ex = ThreadPoolExecutor(len(self.roots))  # the workers join inside /init_weight_transfer_engine
        try:
            futures = [ex.submit(self._post, r, "init_weight_transfer_engine", {"init_info": i})
                       for r, i in zip(self.roots, infos, strict=True)]
            try:
                if self.cuda:
                    from vllm.distributed.weight_transfer.nccl_common import trainer_init

                    self.group = trainer_init({"master_address": self.host, "master_port": self.port,
                                               "world_size": world})
                else:
                    from tidal.inference.backends.vllm.weight_transfer import GlooGroup

                    self.group = GlooGroup(self.host, self.port, 0, world, self.timeout_s)
            except OSError as exc:
                raise RuntimeError(f"cannot open the weight-broadcast rendezvous at {self.host}:{self.port}: "
                                   f"{exc.strerror or exc} (weight_broadcast.host / port)") from exc
            for f in futures:
                f.result()
        finally:
            ex.shutdown(wait=False)  # after a failed rendezvous the workers wait out their own timeout
        log.info("weight broadcast group open at %s:%d (%s, %d inference workers on %d servers)", self.host,
                 self.port, "nccl" if self.cuda else "gloo", world - 1, len(self.roots))

    def close(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None

    def _transfer(self, model: torch.nn.Module, step: int) -> None:
        extra = self.extra(model, step) if self.extra is not None else {}
        specs = policy_weight_specs(model) + [(k, t.dtype, list(t.shape)) for k, t in extra.items()]
        update = {"names": [name for name, _, _ in specs],
                  "dtype_names": [str(dtype).removeprefix("torch.") for _, dtype, _ in specs],
                  "shapes": [shape for _, _, shape in specs]}
        try:
            self._each("pause", params={"mode": "wait"})
            self._each("start_weight_update")
            # the workers receive inside /update_weights while we broadcast: both sides meet in the collectives
            ex = ThreadPoolExecutor(len(self.roots))
            try:
                futures = [ex.submit(self._post, r, "update_weights", {"update_info": update}) for r in self.roots]
                self._broadcast(self._tensors(model, extra))
                for f in futures:
                    f.result()
            finally:
                ex.shutdown(wait=False)  # after a failed broadcast a worker may sit in a collective: do not wait
            self._each("finish_weight_update", {"weight_version": str(step)})
        finally:
            self._resume_all()

    def _resume_all(self) -> None:
        """Resume every server that answers (never leave one paused; a dead one cannot be resumed, and its
        error must not hide the failure that got us here)."""
        for root in self.roots:
            try:
                self._post(root, "resume")
            except Exception as exc:  # noqa: BLE001
                log.warning("could not resume %s after a weight push: %r", root, exc)

    @staticmethod
    def _tensors(model: torch.nn.Module, extra: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """What one push sends, in the order of its specs: the policy's weights, then the extra tensors."""
        yield from policy_weights(model)
        yield from extra.items()

    def _broadcast(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            if self.cuda:
                from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

                packed_nccl_broadcast_producer(iterator=tensors, group=self.group, src=0,
                                               post_iter_func=lambda item: item[1].to(self.device).contiguous())
                torch.cuda.current_stream().synchronize()
            else:
                for _name, w in tensors:
                    self.group.broadcast(w.contiguous(), src=0)
