"""Pushing each new policy straight into the inference servers (train `weight_broadcast.type: nccl`): which
pusher serves the run is chosen here, once (`make_pusher`: vLLM's weight-transfer engine, `push_vllm`, or SGLang's,
`push_sglang`; with QeRL the noisy norms go along), and a push that fails is logged and served again when the
orchestrator asks for it (`push_policy`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from tidal.config.train import TrainConfig
from tidal.trainer.model.noise import qerl_noise
from tidal.transport import weights

log = logging.getLogger("tidal.trainer")


def make_pusher(cfg: TrainConfig, device: torch.device) -> Any:
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


def push_policy(pusher: Any, model: torch.nn.Module, run_dir: Path, step: int) -> float:
    """Push policy `step` into the inference servers; a failure (a server died) is logged, not fatal: the
    orchestrator asks for the policy again once the server is back (`serve_push_request`)."""
    try:
        seconds = pusher.push(model, step)
    except Exception as exc:  # noqa: BLE001 - inference may be restarting; the orchestrator asks again
        log.warning("could not push policy %d into inference (%r); it is pushed again when the orchestrator "
                    "asks for it", step, exc)
        return 0.0
    asked = weights.push_requested(run_dir)
    if asked is not None and asked <= step:
        weights.clear_push_request(run_dir)
    return seconds
