"""GDPO (`multi_objective_aggregation: normalize_then_sum`) and the default aggregation vs TRL 1.16's own code.

TRL computes advantages inside `GRPOTrainer._generate_and_score_completions`, a method that needs a model and
vLLM. The test takes that method's source from the installed TRL 1.16, cuts out the aggregation block (from
`if self.multi_objective_aggregation == ...` to `advantages = torch.nan_to_num(...)`) and runs it, unchanged, on
random float64 rewards: several groups and reward functions, weights, NaN = None rewards, whole unscored rows
(torch's default dtype is float64 meanwhile, so that TRL's `nanstd` Bessel factor, an integer division, is too);
`tidal.orchestrator.advantage` must agree to 1e-10 relative. Skipped where TRL 1.16 is not importable.
"""

from __future__ import annotations

import inspect
import textwrap
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tests.unit.test_trl_parity import import_trl
from tidal.config.orch import AdvantageSection
from tidal.orchestrator.advantage import compute_advantages, gdpo_advantages


def trl_block() -> Any:
    """TRL 1.16's aggregation block, compiled (its own source text)."""
    grpo = import_trl()
    src = textwrap.dedent(inspect.getsource(grpo.GRPOTrainer._generate_and_score_completions))
    lines = src.splitlines()
    start = next(i for i, ln in enumerate(lines) if "unscorable_mask = torch.isnan" in ln)
    end = next(i for i, ln in enumerate(lines) if "advantages = torch.nan_to_num(advantages" in ln)
    block = textwrap.dedent("\n".join(lines[start:end + 1]))
    return compile(block, "trl_grpo_trainer_aggregation", "exec"), grpo


def trl_advantages(per_func: np.ndarray, weights: np.ndarray, group_size: int, mode: str,
                   scale: str = "group") -> np.ndarray:
    code, grpo = trl_block()
    trainer = SimpleNamespace(multi_objective_aggregation=mode, scale_rewards=scale,
                              reward_weights=torch.tensor(weights, dtype=torch.float64),
                              reward_funcs=[None] * per_func.shape[1])
    ns: dict[str, Any] = {"torch": torch, "nanstd": grpo.nanstd, "self": trainer, "device": "cpu",
                          "rewards_per_func": torch.tensor(per_func, dtype=torch.float64),
                          "num_generations": group_size}
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # TRL's nanstd divides int counts: float64, not float32, here
    try:
        exec(code, ns)  # noqa: S102 - TRL's own lines, from the installed wheel
    finally:
        torch.set_default_dtype(old)
    return ns["advantages"].numpy()


def random_rewards(rng: np.random.Generator, groups: int, n: int, k: int) -> np.ndarray:
    r = rng.normal(size=(groups * n, k)) * rng.uniform(0.1, 3.0, size=k)
    r[rng.random(r.shape) < 0.2] = np.nan  # a function returned None
    r[rng.integers(0, groups * n)] = np.nan  # a row nobody scored
    r[:n, 0] = 1.5  # a group whose first function is constant (std 0)
    r[n:2 * n, 1 % k] = np.nan  # a group where one function scored nothing
    return r


@pytest.mark.parametrize(("groups", "n", "k"), [(3, 4, 2), (5, 8, 3), (2, 2, 4), (4, 6, 1)])
def test_normalize_then_sum_matches_trl(groups: int, n: int, k: int) -> None:
    rng = np.random.default_rng()
    largest = 0.0
    for _ in range(5):  # five fresh draws: a tiny batch (2 groups of 2) can draw all-NaN/constant groups, all zero
        per_func = random_rewards(rng, groups, n, k)
        weights = rng.uniform(-1.0, 2.0, size=k)
        ours = gdpo_advantages(per_func, weights, n)
        theirs = trl_advantages(per_func, weights, n, "normalize_then_sum")
        np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-12)
        assert (ours[np.isnan(per_func).all(axis=1)] == 0).all()
        largest = max(largest, float(np.abs(ours).max()))
    assert largest > 0.1  # the comparison saw non-trivial advantages


def test_normalize_then_sum_differs_from_sum_then_normalize() -> None:
    """The two aggregations are different algorithms (TRL's own code for the default too, no NaN here)."""
    rng = np.random.default_rng()
    per_func = rng.normal(size=(12, 3)) * np.array([0.1, 1.0, 10.0])
    weights = np.array([1.0, 1.0, 1.0])
    gdpo = gdpo_advantages(per_func, weights, 4)
    sec = AdvantageSection(scale_rewards="group")
    rewards = (per_func * weights).sum(axis=1)
    default = np.array([a[0] for a in compute_advantages(sec, 4, rewards, np.ones(12, int), None, None)])
    np.testing.assert_allclose(default, trl_advantages(per_func, weights, 4, "sum_then_normalize"), rtol=1e-10)
    assert np.abs(gdpo - default).max() > 1e-3


def test_compute_advantages_routes_gdpo_and_zeroes_unjudged() -> None:
    """Orch `advantage.multi_objective_aggregation` selects GDPO; an unjudged rollout is an unscored row."""
    rng = np.random.default_rng()
    per_func = rng.normal(size=(8, 2))
    weights = [0.5, 2.0]
    judged = np.ones(8, bool)
    judged[3] = False
    sec = AdvantageSection(multi_objective_aggregation="normalize_then_sum")
    out = compute_advantages(sec, 4, np.zeros(8), np.arange(1, 9), None, None, judged, per_func, weights)
    rows = per_func.copy()
    rows[3] = np.nan
    expect = trl_advantages(rows, np.array(weights), 4, "normalize_then_sum")
    np.testing.assert_allclose([a[0] for a in out], expect, rtol=1e-10, atol=1e-12)
    assert [len(a) for a in out] == list(range(1, 9)) and out[3][0] == 0.0


def test_normalize_then_sum_against_a_float64_loop() -> None:
    """Without TRL too: the formula of docs/algorithms.md, written as plain loops over groups and functions."""
    rng = np.random.default_rng()
    groups, n, k = 3, 5, 3
    per_func = rng.normal(size=(groups * n, k))
    per_func[rng.random(per_func.shape) < 0.15] = np.nan
    per_func[7] = np.nan
    w = rng.uniform(0.2, 2.0, size=k)
    total = np.zeros(groups * n)
    for g in range(groups):
        for f in range(k):
            vals = [per_func[g * n + i, f] for i in range(n) if not np.isnan(per_func[g * n + i, f])]
            if len(vals) < 2:
                continue  # std undefined: the term is NaN and skipped
            mean = sum(vals) / len(vals)
            std = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5
            for i in range(n):
                if not np.isnan(per_func[g * n + i, f]):
                    total[g * n + i] += w[f] * (per_func[g * n + i, f] - mean) / (std + 1e-4)
    scored = [i for i in range(groups * n) if not np.isnan(per_func[i]).all()]
    mean = sum(total[i] for i in scored) / len(scored)
    std = (sum((total[i] - mean) ** 2 for i in scored) / (len(scored) - 1)) ** 0.5
    expect = [(total[i] - mean) / (std + 1e-4) if i in scored else 0.0 for i in range(groups * n)]
    np.testing.assert_allclose(gdpo_advantages(per_func, w, n), expect, rtol=1e-10, atol=1e-12)


def test_normalize_then_sum_refuses_its_ignored_keys() -> None:
    with pytest.raises(ValueError, match="normalize_then_sum"):
        AdvantageSection(multi_objective_aggregation="normalize_then_sum", scale_rewards="group")
    with pytest.raises(ValueError, match="normalize_then_sum"):
        AdvantageSection(multi_objective_aggregation="normalize_then_sum", length_weighted_mean=True)
