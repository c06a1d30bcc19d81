"""Train `weight_broadcast.backend: sglang` picks the SGLang pusher (tidal.trainer.publish.push_sglang), which needs
a CUDA trainer; the push itself runs in tests/e2e/test_sglang_gpu.py on a GPU."""

from __future__ import annotations

import pytest
import torch

from tidal.config.train import TrainConfig
from tidal.trainer.publish.push import make_pusher
from tidal.trainer.publish.push_vllm import WeightPusher


def config(backend: str) -> TrainConfig:
    return TrainConfig.model_validate({"model": "tidal:tiny-reverse", "weight_broadcast": {
        "type": "nccl", "backend": backend, "base_url": ["http://127.0.0.1:9/v1"]}})


def test_make_pusher_picks_the_backend_and_sglang_refuses_a_cpu_trainer():
    pusher = make_pusher(config("vllm"), torch.device("cpu"))
    assert isinstance(pusher, WeightPusher)
    pusher.close()
    with pytest.raises(ValueError, match="backend sglang needs the trainer on a CUDA GPU"):
        make_pusher(config("sglang"), torch.device("cpu"))


def test_group_ranks_follow_each_servers_tp_size():
    from tidal.trainer.publish.push_sglang import rank_offsets

    assert rank_offsets([1]) == ([1], 2)
    assert rank_offsets([2, 1, 4]) == ([1, 3, 4], 8), "server i's workers sit after the previous servers' workers"


def test_the_update_request_announces_what_is_broadcast_in_sglangs_fields():
    from tidal.models.sources import resolve_model
    from tidal.trainer.model.load import load_base_model
    from tidal.trainer.publish.broadcast import policy_weight_specs, policy_weights
    from tidal.trainer.publish.push_sglang import update_request

    model = load_base_model(resolve_model("tidal:tiny-reverse"), torch.device("cpu"), torch.bfloat16)
    body = update_request(policy_weight_specs(model), 5)
    sent = list(policy_weights(model))
    assert body["names"] == [n for n, _ in sent], "names in the order rank 0 broadcasts the tensors"
    assert body["dtypes"] == [str(t.dtype).removeprefix("torch.") for _, t in sent]
    assert body["shapes"] == [list(t.shape) for _, t in sent]
    assert body["weight_version"] == "5" and body["flush_cache"] is True
    assert all(hasattr(torch, d) for d in body["dtypes"]), "SGLang reads each dtype as getattr(torch, name)"
