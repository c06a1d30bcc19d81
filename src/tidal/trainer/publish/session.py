"""What every weight pusher shares, engine-neutral (train `weight_broadcast.type: nccl`): the process group opened
at the first push and kept, a failed push closing it (the next push reopens it), the HTTP client to the servers'
roots, and the retry state of the pushes the orchestrator asks for again.

A push that fails (a server died) is logged, not fatal (`push_policy`): the orchestrator writes a re-push request
(`tidal.transport.weights.request_push`) once a restarted server is behind, and the trainer, waiting for its next
batch, serves it (`serve_push_request`), retrying every 2 s until the push goes through. The engines' pushers
(`tidal.trainer.publish.push_vllm`, `tidal.trainer.publish.push_sglang`) open the group (`_open`), move one policy
(`_transfer`) and close it (`close`); `tidal.trainer.publish.push` picks one of them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch

from tidal.inference.protocol import server_root
from tidal.transport import weights

log = logging.getLogger("tidal.trainer")

ExtraTensors = Callable[[torch.nn.Module, int], dict[str, torch.Tensor]]
"""(model, step) -> more named tensors pushed with policy `step` (QeRL: the noisy norms)."""


class PushSession:
    """Broadcasts policies into the servers at `urls` (their `/v1` base URLs) through a process group kept
    between pushes; subclasses speak one engine's routes."""

    def __init__(self, urls: list[str], host: str, port: int, timeout_s: float, api_key: str | None,
                 device: torch.device, extra: ExtraTensors | None = None) -> None:
        self.extra = extra
        self.roots = [server_root(u) for u in urls]
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.device = device  # merged tensors go there for NCCL (rank 0's view of a sharded policy is on CPU)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0), headers=headers)
        self.group: Any = None  # the engine's process group (NCCL / gloo), None while closed
        self.pushed = 0
        self.failures = 0  # failed re-push attempts in a row (`serve_push_request` logs some of them)

    def _open(self) -> None:
        raise NotImplementedError

    def _transfer(self, model: torch.nn.Module, step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def push(self, model: torch.nn.Module, step: int) -> float:
        """Broadcast `model`'s policy as version `step`; returns the seconds it took. Raises on failure (the
        group is then closed, and reopened by the next push)."""
        t0 = time.monotonic()
        try:
            if self.group is None:
                self._open()
            self._transfer(model, step)
        except BaseException:
            self.close()
            raise
        self.pushed = step
        return time.monotonic() - t0

    def push_policy(self, model: torch.nn.Module, run_dir: Path, step: int) -> float:
        """Push policy `step` into the inference servers; a failure (a server died) is logged, not fatal: the
        orchestrator asks for the policy again once the server is back (`serve_push_request`)."""
        try:
            seconds = self.push(model, step)
        except Exception as exc:  # noqa: BLE001 - inference may be restarting; the orchestrator asks again
            log.warning("could not push policy %d into inference (%r); it is pushed again when the orchestrator "
                        "asks for it", step, exc)
            return 0.0
        asked = weights.push_requested(run_dir)
        if asked is not None and asked <= step:
            weights.clear_push_request(run_dir)
        return seconds

    def serve_push_request(self, model: torch.nn.Module, run_dir: Path, step: int) -> None:
        """While waiting for a batch: push the current policy (`step`) again if the orchestrator asked for it."""
        asked = weights.push_requested(run_dir)
        if asked is None or asked > step or step == 0:
            return
        if self.failures == 0:
            log.info("the orchestrator asked for policy %d again (an inference server restarted); pushing policy "
                     "%d", asked, step)
        try:
            self.push(model, step)
        except Exception as exc:  # noqa: BLE001 - tried again on the next poll
            if self.failures % 15 == 0:
                log.warning("could not push policy %d yet (%r); retrying every 2 s", step, exc)
            self.failures += 1
            time.sleep(2.0)
            return
        log.info("pushed policy %d again", step)
        self.failures = 0
        weights.clear_push_request(run_dir)
