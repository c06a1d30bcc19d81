"""The adaptive entropy coefficient (train `loss.use_adaptive_entropy`) is checkpointed with the trainer state: a
resumed run continues the coefficient and the entropy gate where the checkpoint left them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.unit.test_train_step import own_batch
from tidal.config.train import TrainCkptSection, TrainConfig
from tidal.models.sources import resolve_model
from tidal.trainer.grpo import train_step
from tidal.trainer.policy import build_policy, restore, save
from tidal.trainer.step.entropy_control import EntropyControl


def adaptive_config() -> TrainConfig:
    return TrainConfig(model=resolve_model("tidal:tiny-reverse"), learning_rate=1e-2, per_device_train_batch_size=1,
                       sequence_len=40, steps_per_generation=2, ckpt=TrainCkptSection(interval=1),
                       loss={"loss_type": "dapo", "entropy_coef": 0.1, "use_adaptive_entropy": True,
                             "entropy_target": 100.0, "entropy_coef_delta": 0.03, "entropy_coef_max": 0.5})


def test_resumed_run_continues_the_entropy_coefficient(tmp_path):
    cfg = adaptive_config()
    a = build_policy(cfg, 10)
    assert a.entropy is not None
    batch = own_batch(a.model, np.random.default_rng(1), [False] * 4)
    train_step(a.model, a.opt, batch, cfg, a.device, a.pad_id, sched=a.sched, entropy=a.entropy)
    assert a.entropy.coef == pytest.approx(0.16) and math.isfinite(a.entropy.last_entropy)  # 0.1 + 2 x 0.03
    save(a, tmp_path, 1, cfg)
    b = build_policy(cfg, 10)
    assert b.entropy is not None and b.entropy.coef == 0.1 and math.isinf(b.entropy.last_entropy)
    restore(b, tmp_path, 1)
    assert b.entropy.coef == a.entropy.coef and b.entropy.last_entropy == a.entropy.last_entropy
    assert b.entropy.applied(cfg.loss) == pytest.approx(0.16), "the gate is open from the first resumed step"
    nxt = own_batch(a.model, np.random.default_rng(2), [False] * 4)
    ma = train_step(a.model, a.opt, nxt, cfg, a.device, a.pad_id, sched=a.sched, entropy=a.entropy)
    mb = train_step(b.model, b.opt, nxt, cfg, b.device, b.pad_id, sched=b.sched, entropy=b.entropy)
    assert ma["entropy_coef"] == mb["entropy_coef"] == pytest.approx(0.22)


def test_entropy_state_round_trips_before_the_first_step():
    ec = EntropyControl(0.3)
    fresh = EntropyControl(0.0, last_entropy=1.0, window=[2.0, 3.0])
    fresh.load(ec.state())
    assert fresh.coef == 0.3 and math.isinf(fresh.last_entropy) and fresh.window == [0.0, 0.0]
    with pytest.raises(ValueError, match="coefficient"):
        fresh.load({"coef": None})
