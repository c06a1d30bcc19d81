"""Bad input never kills a run silently: failing reward functions score `reward_default` and are counted and
logged once; empty completions train; corrupt batch files are named."""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import pytest
import torch

from tidal.config.orch import OrchConfig
from tidal.config.train import TrainConfig
from tidal.envs import make_env
from tidal.envs.base import Example
from tidal.inference.protocol import Completion
from tidal.orchestrator.advantage import compute_advantages
from tidal.orchestrator.assemble import build_batch
from tidal.orchestrator.scoring import Scorer
from tidal.transport.batch import BatchFormatError, TrainingBatch
from tidal.transport.filesystem import BatchReader

CALLS: dict[str, int] = {}


def raises(completions, **_):
    raise ZeroDivisionError("model wrote 1/0")


def nan_and_inf(completions, **_):
    return [math.nan, math.inf, 0.5, None][: len(completions)]


def slow(completions, **_):
    time.sleep(5)
    return [1.0] * len(completions)


def wrong_count(completions, **_):
    return [1.0]


def not_a_list(completions, **_):
    return 3


def scorer(*names: str, default: float = -1.0, timeout: float = 0.5) -> Scorer:
    cfg = OrchConfig.model_validate({
        "reward_default": default, "reward_timeout_s": timeout,
        "reward_funcs": [{"import_path": f"tests.unit.test_bad_inputs:{n}"} for n in names]})
    return Scorer(make_env("reverse-text", {}), cfg)


def group(n: int = 4) -> tuple[Example, list[Completion]]:
    ex = Example(prompt=[{"role": "user", "content": "abc"}], answer="cba")
    return ex, [Completion([1, 2], [-0.1, -0.2], "cba", "stop") for _ in range(n)]


def test_raising_nan_inf_wrong_count_and_timeout_score_the_default_and_are_counted(caplog):
    s = scorer("raises", "nan_and_inf", "slow", "wrong_count", "not_a_list")
    ex, comps = group()
    with caplog.at_level(logging.WARNING, logger="tidal.orch"):
        t0 = time.monotonic()
        out = s.score(ex, comps, step=1)
        assert time.monotonic() - t0 < 4, "a slow reward must not hold the step beyond reward_timeout_s"
        s.score(ex, comps, step=2)
    assert np.allclose(out[:, 0], s.env.reward(ex, "cba"))  # the environment's own reward is untouched
    assert (out[:, 1] == -1).all()
    assert out[0, 2] == -1 and out[1, 2] == -1 and out[2, 2] == 0.5 and math.isnan(out[3, 2])  # None: n/a
    assert (out[:, 3] == -1).all() and (out[:, 4] == -1).all() and (out[:, 5] == -1).all()
    counts = s.take_error_counts()  # two steps' worth
    assert counts["reward/raises/errors"] == 8 and counts["reward/nan_and_inf/errors"] == 4
    assert counts["reward/slow/errors"] == 8 and counts["reward/wrong_count/errors"] == 8
    assert counts["reward/reverse-text/errors"] == 0
    assert counts["reward/errors"] == 8 + 4 + 8 + 8 + 8
    assert s.take_error_counts()["reward/errors"] == 0  # reset per step
    logged = [r.getMessage() for r in caplog.records]
    assert sum("'raises' raised" in m for m in logged) == 1, "logged once, not every step"
    assert any("ZeroDivisionError: model wrote 1/0" in m for m in logged), "with its traceback"
    assert sum("'slow' timed out" in m for m in logged) == 1
    assert sum("'nan_and_inf' gave bad output" in m and "nan" in m for m in logged) == 1


def test_environment_reward_failure_is_contained_too(monkeypatch):
    s = scorer(default=0.0)
    monkeypatch.setattr(s.env, "reward", lambda ex, text: float("nan"))
    ex, comps = group(2)
    assert (s.score(ex, comps, 1)[:, 0] == 0).all()
    assert s.take_error_counts()["reward/reverse-text/errors"] == 2


def test_empty_completions_make_a_valid_batch_that_trains(tmp_path):
    from tidal.models.sources import resolve_model
    from tidal.trainer.grpo import train_step
    from tidal.trainer.model.load import load_policy

    cfg = OrchConfig.model_validate({"batch_size": 4, "rollouts_per_example": 4, "seq_len": 64})
    comps = [Completion([], [], "", "stop"), Completion([5, 6, 7], [-1.0, -0.5, -2.0], "xyz", "stop"),
             Completion([], [], "", "length"), Completion([9], [-0.3], "q", "stop")]
    rewards = np.array([0.0, 1.0, 0.0, 0.5])
    lens = np.array([len(c.token_ids) for c in comps])
    adv = compute_advantages(cfg.advantage, cfg.rollouts_per_example, rewards, lens, None, None)
    batch, _ = build_batch(1, [[1, 2, 3]], [comps], rewards, adv, 0, cfg)
    batch.save(tmp_path / "b.safetensors")
    back = TrainingBatch.load(tmp_path / "b.safetensors")
    assert list(back.lengths) == [3, 6, 3, 4] and int(back.loss_mask.sum()) == 4
    tcfg = TrainConfig(model=resolve_model("tidal:tiny-reverse"), sequence_len=64)
    model, device = load_policy(tcfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    out = train_step(model, opt, back, tcfg, device, 0)
    assert out["tokens"] == 4 and math.isfinite(out["loss"])


def test_corrupt_batch_file_error_names_the_file(tmp_path):
    (tmp_path / "rollouts").mkdir()
    bad = tmp_path / "rollouts" / "step_1.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(BatchFormatError, match=r"rollouts/step_1\.safetensors is corrupt"):
        BatchReader(tmp_path).wait(1, timeout_s=5)


def test_first_step_after_resume_waits_wait_for_weights_timeout_not_weights_timeout(tmp_path):
    """`ckpt.wait_for_weights_timeout` bounds the wait for the policy right after a resume (nothing is
    broadcast here, so the wait must end with a TimeoutError after ~0.5 s, not after weights_timeout_s)."""
    import asyncio
    import random

    from tidal.config.orch import ClientSection
    from tidal.inference.backends.vllm.client import VllmClient
    from tidal.orchestrator.collect import sample_step
    from tidal.orchestrator.policy import PolicyTracker

    cfg = OrchConfig.model_validate({"ckpt": {"resume_step": -1, "wait_for_weights_timeout": 0.5},
                                     "weights_timeout_s": 600, "batch_size": 4, "rollouts_per_example": 4})

    async def go(first: bool) -> float:
        client = VllmClient(ClientSection(base_url=["http://127.0.0.1:9/v1"]))
        policy = PolicyTracker(client, "m", tmp_path, "default")
        t0 = time.monotonic()
        try:
            with pytest.raises(TimeoutError, match="policy 3 was not broadcast"):
                await asyncio.wait_for(sample_step(5, cfg, None, random.Random(0), client, "m", policy, {}, None,
                                                   first_after_resume=first), timeout=3)
        finally:
            await client.close()
        return time.monotonic() - t0

    assert asyncio.run(go(True)) < 2.5
    with pytest.raises(TimeoutError):  # without the resume bound, weights_timeout_s (600 s) applies
        asyncio.run(asyncio.wait_for(go(False), timeout=3))
