"""The trainer's memory at run time (`tidal.trainer.memory`): `gradient_checkpointing: auto` on CPU, the calibration
step the GPU split measures (run here on CPU, where it measures the peak RSS; on CUDA in tests/gpu), and what a CUDA
out-of-memory error turns into."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.config import TrainConfig
from tidal.trainer import calibrate, memory
from tidal.trainer.memory import TrainerOutOfMemory, exits_on_oom, oom_message, resolve_checkpointing


def test_checkpointing_auto_is_off_on_cpu_and_explicit_values_stand():
    cpu = torch.device("cpu")
    assert resolve_checkpointing(TrainConfig(model="m"), cpu) is False  # as the old default: CPU speed unchanged
    assert resolve_checkpointing(TrainConfig(model="m", gradient_checkpointing=True), cpu) is True
    assert resolve_checkpointing(TrainConfig(model="m", gradient_checkpointing=False), torch.device("cuda")) is False
    assert memory.checkpointing_needed(12.0, 10.0) and not memory.checkpointing_needed(9.0, 10.0)


def test_the_bundled_trainer_loads_without_checkpointing_on_cpu():
    from tidal.trainer.model.load import load_policy

    model, _ = load_policy(TrainConfig(model="tidal:tiny-reverse", device="cpu"))
    assert not model.get_base_model().is_gradient_checkpointing  # type: ignore[operator]


def test_the_oom_message_names_peak_estimate_and_keys():
    text = oom_message(7.27, 9.0, 79.18, checkpointing=False)
    assert "measured peak 7.27 GiB" in text and "estimate 9.00 GiB" in text and "79.2 GiB GPU" in text
    for key in ("gradient_checkpointing: true", "per_device_train_batch_size", "sequence_len",
                "infer gpu_memory_utilization"):
        assert key in text
    assert "gradient_checkpointing" not in oom_message(7.27, None, None, checkpointing=True)
    assert "estimate none" in oom_message(1.0, None, None, checkpointing=True)


def test_a_cuda_oom_becomes_the_message_and_other_errors_pass(tmp_path):
    cfg = TrainConfig(model="tidal:tiny-reverse")
    with pytest.raises(TrainerOutOfMemory, match="CUDA out of memory in the trainer: measured peak"):
        with exits_on_oom(cfg):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(ValueError), exits_on_oom(cfg):
        raise ValueError("not memory")


def test_calibrate_runs_one_step_of_the_largest_micro_batch():
    cfg = TrainConfig(model="tidal:tiny-reverse", device="cpu", per_device_train_batch_size=2, sequence_len=64,
                      gradient_checkpointing=False)
    batch = calibrate.synthetic_batch(2, 64, 128)
    assert batch.tokens.shape == (128,) and batch.lengths.tolist() == [64, 64]
    assert batch.loss_mask[:16].sum() == 0 and batch.loss_mask[16:64].all()  # a quarter prompt
    peak = calibrate.calibrate(cfg)
    assert 0 < peak["allocated"] <= peak["reserved"] < 64  # CPU: the process's peak RSS in GiB


def test_the_calibration_runs_in_a_child_and_reports_its_peak():
    cfg = TrainConfig(model="tidal:tiny-reverse", device="cpu", per_device_train_batch_size=1, sequence_len=32,
                      cpu_affinity=[0])
    got = calibrate.measure_in_child(cfg, False)
    assert got is not None and 0 < got < 64 and not math.isinf(got)
    bad = cfg.model_copy(update={"model": "/nonexistent/model"})
    with pytest.warns(UserWarning, match="calibration failed"):
        assert calibrate.measure_in_child(bad, False) is None


def test_a_replaying_moe_calibration_batch_carries_routes_and_the_step_runs(tmp_path):
    """A MoE run with router replay (the runs where the estimate is least sure) is measured, not refused: the
    calibration batch carries routes, top_k distinct experts per token and layer (an H100 run's calibration died on
    'batch 1 carries no routed experts' and the split fell back to the estimate)."""
    from tests.archs import build
    from tidal.models.config import model_config, text_config
    from tidal.models.routes import moe_shape

    model = build("qwen3-moe", tmp_path / "moe")
    config = text_config(model_config(str(model)))
    layers, experts, top_k = moe_shape(config)
    routes = calibrate.synthetic_routes(96, config, True, seed=3)
    assert routes.shape == (96, layers, top_k) and int(routes.max()) < experts
    assert all(len(set(r.tolist())) == top_k for r in routes.reshape(-1, top_k))  # distinct experts
    assert calibrate.synthetic_routes(96, config, False) is None
    assert calibrate.synthetic_routes(96, {**config, "model_type": "not_replayed"}, "auto") is None
    assert calibrate.synthetic_routes(96, text_config(model_config("tidal:tiny-reverse")), True) is None  # dense
    cfg = TrainConfig(model=str(model), device="cpu", per_device_train_batch_size=2, sequence_len=48,
                      gradient_checkpointing=False, router_replay=True)
    peak = calibrate.calibrate(cfg)
    assert 0 < peak["allocated"] <= peak["reserved"] < 64
