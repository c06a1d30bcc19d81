"""Train `weight_broadcast.backend: sglang` picks the SGLang pusher (tidal.trainer.weight_push_sglang), which needs
a CUDA trainer; the push itself runs in tests/e2e/test_sglang_gpu.py on a GPU."""

from __future__ import annotations

import pytest
import torch

from tidal.config.train import TrainConfig
from tidal.trainer.grpo import make_pusher
from tidal.trainer.weight_push import WeightPusher


def config(backend: str) -> TrainConfig:
    return TrainConfig.model_validate({"model": "tidal:tiny-reverse", "weight_broadcast": {
        "type": "nccl", "backend": backend, "base_url": ["http://127.0.0.1:9/v1"]}})


def test_make_pusher_picks_the_backend_and_sglang_refuses_a_cpu_trainer():
    pusher = make_pusher(config("vllm"), torch.device("cpu"))
    assert isinstance(pusher, WeightPusher)
    pusher.close()
    with pytest.raises(ValueError, match="backend sglang needs the trainer on a CUDA GPU"):
        make_pusher(config("sglang"), torch.device("cpu"))
