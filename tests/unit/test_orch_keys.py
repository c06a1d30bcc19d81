"""Orchestrator keys with a pure effect: `max_off_policy_steps` (stale batches are emptied, step numbering
kept), `model.lora_rank` / `model.lora_alpha` (a broadcast adapter with other settings is refused)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tidal.config.orch import OrchConfig
from tidal.inference.protocol import Completion
from tidal.orchestrator.assemble import build_batch
from tidal.transport.weights import check_adapter


def one_group(rng: np.random.Generator) -> list[Completion]:
    return [Completion([int(t) for t in rng.integers(3, 100, 5)], list(rng.normal(-1, 0.1, 5)), "x", "stop")
            for _ in range(2)]


@pytest.mark.parametrize("limit", [0, 2, 5])
def test_max_off_policy_steps_empties_only_batches_staler_than_the_limit(limit):
    rng = np.random.default_rng(limit)
    cfg = OrchConfig.model_validate({"batch_size": 2, "rollouts_per_example": 2, "seq_len": 64,
                                     "max_async_level": 0, "max_off_policy_steps": limit})
    group = one_group(rng)
    for lag in range(0, 7):
        step = 10
        batch, metrics = build_batch(step, [[1, 2]], [group], np.array([0.0, 1.0]),
                                     [np.zeros(5), np.ones(5)], step - 1 - lag, cfg)
        assert batch.step == step and batch.off_policy_level == (lag if lag <= limit else 0)  # empty: nothing trains
        if lag <= limit:
            assert batch.tokens.size == 2 * 7 and batch.loss_mask.sum() == 10, lag
        else:
            assert batch.tokens.size == 0 and batch.lengths.size == 0, f"lag {lag} > {limit} must be dropped"


def test_adapter_with_other_lora_settings_is_refused(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    check_adapter(tmp_path, None, None)
    check_adapter(tmp_path, 8, 16)
    with pytest.raises(ValueError, match=r"adapter_config.json has rank 8 but orch model.lora_rank is 16"):
        check_adapter(tmp_path, 16, None)
    with pytest.raises(ValueError, match=r"alpha 16 but orch model.lora_alpha is 32"):
        check_adapter(tmp_path, 8, 32)


def test_grpo_refuses_an_orch_lora_rank_that_differs_from_the_trainers(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo", "--dry-run", "--output-dir", str(tmp_path),
                        "--orch.model.lora_rank", "8", "--train.lora_rank", "16"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "orch model.lora_rank is 8 but train lora_rank is 16" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo", "--dry-run", "--output-dir", str(tmp_path),
                        "--orch.model.lora_rank", "16", "--train.lora_rank", "16"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
