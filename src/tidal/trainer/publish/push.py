"""Pushing each new policy straight into the inference servers (train `weight_broadcast.type: nccl`): what the
training loop sees of a pusher (`Pusher`), and which pusher serves the run, chosen here, once (`make_pusher`:
vLLM's weight-transfer engine, `push_vllm`, or SGLang's, `push_sglang`; with QeRL the noisy norms go along). Both
are `tidal.trainer.publish.session.PushSession`s: a failed push is logged and served again when the orchestrator
asks for it, each pusher keeping its own retry state.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

import torch

from tidal.config.train import TrainConfig
from tidal.trainer.model.noise import qerl_noise


class Pusher(Protocol):
    """A weight pusher into one engine's servers (`tidal.trainer.publish.session.PushSession`)."""

    pushed: int
    """The last policy step pushed (0: none yet)."""

    def push(self, model: torch.nn.Module, step: int) -> float:
        """Broadcast `model`'s policy as version `step`; the seconds it took. Raises on failure."""
        ...

    def push_policy(self, model: torch.nn.Module, run_dir: Path, step: int) -> float:
        """`push` after a training step: a failure is logged, not raised (0.0 seconds)."""
        ...

    def serve_push_request(self, model: torch.nn.Module, run_dir: Path, step: int) -> None:
        """While waiting for a batch: push policy `step` again when the orchestrator asked for it."""
        ...

    def close(self) -> None:
        """Close the process group (the next push reopens it)."""
        ...


def make_pusher(cfg: TrainConfig, device: torch.device) -> Pusher | None:
    """The weight pusher for train `weight_broadcast.type: nccl` into vLLM or SGLang servers
    (`weight_broadcast.backend`; with QeRL: pushing the noisy norms too), else None."""
    wb = cfg.weight_broadcast
    if wb.type != "nccl":
        return None
    from tidal.trainer.model.noise import noisy_norms
    from tidal.trainer.publish.push_vllm import WeightPusher

    def norms(model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
        sigma, seed = qerl_noise(cfg, step) or (0.0, cfg.seed)
        return noisy_norms(model, sigma, seed, step)

    extra = norms if cfg.noise_scheduler.enabled else None
    if wb.backend == "sglang":
        from tidal.trainer.publish.push_sglang import SglangWeightPusher

        return SglangWeightPusher(wb.base_url, wb.host, wb.port, wb.timeout, os.environ.get(wb.api_key_var), device,
                                  extra)
    return WeightPusher(wb.base_url, wb.host, wb.port, wb.timeout, os.environ.get(wb.api_key_var), device, extra)
