"""orch `extend_flat_groups` without a server: the pooled advantages against a float64 reference on fresh random
rewards, the choice of the completions a pooled group trains on, the pool's record, `reward/sampled_mean`, and the
keys it refuses to combine with."""

from __future__ import annotations

import random

import numpy as np
import pytest
from pydantic import ValidationError

from tidal.config.orch import OrchConfig
from tidal.config.orch_sections import AdvantageSection
from tidal.orchestrator.advantage import EPS, compute_advantages, group_advantages, pooled_advantages
from tidal.orchestrator.extend import choose, is_flat, pool_of, sampled_mean


def reference(rewards, judged, k, pools, scale):
    """Per rollout, in plain Python floats: a pooled group against its pool, the others against their own judged
    rewards (TRL's formula, ddof 1 + EPS)."""
    out = []
    ok = [r for r, j in zip(rewards, judged, strict=True) if j]
    bmean = sum(ok) / len(ok)
    bstd = (sum((r - bmean) ** 2 for r in ok) / (len(ok) - 1)) ** 0.5
    for g in range(len(rewards) // k):
        rs, js = rewards[g * k:(g + 1) * k], judged[g * k:(g + 1) * k]
        own = [r for r, j in zip(rs, js, strict=True) if j]
        if pools[g] is not None:
            mean, std = pools[g]
        else:
            mean = sum(own) / len(own)
            std = (sum((r - mean) ** 2 for r in own) / (len(own) - 1)) ** 0.5 if len(own) > 1 else 0.0
        scale_by = {"group": std + EPS, "batch": bstd + EPS, "none": 1.0}[scale]
        out += [(r - mean) / scale_by if j else 0.0 for r, j in zip(rs, js, strict=True)]
    return np.array(out)


@pytest.mark.parametrize("scale", ["none", "group", "batch"])
@pytest.mark.parametrize("seed", range(4))
def test_pooled_advantages_match_a_float64_reference(scale, seed):
    rng = np.random.default_rng(seed)
    k, groups = int(rng.integers(2, 7)), int(rng.integers(2, 6))
    rewards = rng.integers(0, 3, k * groups).astype(np.float64) * rng.random()
    judged = rng.random(k * groups) > 0.15
    for g in range(groups):  # at least 2 judged per group, as the filler keeps
        judged[g * k:g * k + 2] = True
    pools = [(float(rng.random()), float(rng.random())) if rng.random() < 0.5 else None for _ in range(groups)]
    pools[0] = pools[0] or (0.3, 0.4)
    base = group_advantages(rewards, k, scale, judged=judged)
    got = pooled_advantages(base, rewards, k, pools, scale, judged)
    np.testing.assert_allclose(got, reference(rewards.tolist(), judged.tolist(), k, pools, scale), rtol=1e-12,
                               atol=1e-12)
    lens = rng.integers(1, 5, k * groups)
    per_token = compute_advantages(AdvantageSection(scale_rewards=scale), k, rewards, lens, None, None, judged,
                                   pools=pools)
    assert [len(a) for a in per_token] == lens.tolist()
    np.testing.assert_allclose([a[0] for a in per_token], got, rtol=0, atol=0)
    without = compute_advantages(AdvantageSection(scale_rewards=scale), k, rewards, lens, None, None, judged)
    assert not np.allclose([a[0] for a in without], got), "the pools must change the pooled groups' advantages"


def test_a_rare_success_scores_against_the_pool():
    """One success in 24 tries, trained in a group of 8 with 7 failures: against the pool's 1/24, not 1/8."""
    k = 8
    rewards = np.array([1.0] + [0.0] * 7)
    pool = pool_of(np.array([0.0] * 8 + [1.0] + [0.0] * 15), np.ones(24, dtype=bool), k)
    assert pool.mean == pytest.approx(1 / 24) and pool.size == 24 and pool.first_mean == 0.0
    assert pool.std == pytest.approx(np.std([1.0] + [0.0] * 23, ddof=1))
    adv = pooled_advantages(group_advantages(rewards, k), rewards, k, [(pool.mean, pool.std)])
    assert adv[0] == pytest.approx(23 / 24) and adv[1:] == pytest.approx(np.full(7, -1 / 24))


@pytest.mark.parametrize("seed", range(20))
def test_choose_keeps_the_minority_up_to_half_the_group(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(2, 9))
    first = float(rng.integers(0, 2))
    extra = rng.integers(0, 3, k * int(rng.integers(1, 4))).astype(np.float64)
    rewards = np.concatenate([np.full(k, first), extra])
    rewards[k + int(rng.integers(0, extra.size))] = 1.0 - first  # the extension found a signal
    ok = rng.random(rewards.size) > 0.1
    ok[:2] = True
    ok[rewards != first] = True
    assert not is_flat(rewards, ok)
    idx = choose(rewards, ok, k, random.Random(seed))
    assert idx == sorted(set(idx)) and len(idx) == k and all(0 <= i < rewards.size for i in idx)
    other = [i for i in range(rewards.size) if ok[i] and rewards[i] != first]
    same = [i for i in range(rewards.size) if ok[i] and rewards[i] == first]
    took_other = [i for i in idx if i in other]
    assert len(took_other) >= min(len(other), max(1, k // 2))
    if len(same) >= k - min(len(other), max(1, k // 2)):  # enough of the first draw's reward to fill the rest
        assert len(took_other) == min(len(other), max(1, k // 2))
    assert not is_flat(rewards[idx], ok[idx]), "the chosen group must hold a signal"
    assert choose(rewards, ok, k, random.Random(seed)) == idx, "seeded: the same choice again"


def test_is_flat_reads_judged_rewards_only():
    assert is_flat(np.array([1.0, 1.0, 0.0]), np.array([True, True, False]))
    assert not is_flat(np.array([1.0, 1.0, 0.0]), np.ones(3, dtype=bool))
    assert not is_flat(np.array([1.0, 0.0]), np.array([True, False])), "one judged rollout is not a group"


def test_sampled_mean_is_the_first_draws_mean():
    rewards = np.array([1.0, 0.0, 1.0, 1.0, 0.5, 0.5])
    ok = np.array([True, True, True, False, True, True])
    pools = [None, pool_of(np.array([1.0, 1.0, 0.0, 0.0]), np.ones(4, dtype=bool), 2), None]
    assert sampled_mean(rewards, ok, 2, pools) == pytest.approx((0.5 + 1.0 + 0.5) / 3)


def orch(**kw) -> OrchConfig:
    return OrchConfig.model_validate({"batch_size": 8, "rollouts_per_example": 4, "extend_flat_groups": 2, **kw})


@pytest.mark.parametrize(("kw", "key"), [
    ({"async_mode": "in_flight"}, "async_mode"),
    ({"rollouts_per_example": 1}, "rollouts_per_example"),
    ({"advantage": {"type": "process"}}, "advantage.type"),
    ({"advantage": {"length_weighted_mean": True}}, "advantage.length_weighted_mean"),
    ({"advantage": {"multi_objective_aggregation": "normalize_then_sum"}}, "advantage.multi_objective_aggregation"),
])
def test_extend_refuses_what_it_does_not_combine_with(kw, key):
    with pytest.raises(ValidationError, match=f"extend_flat_groups: 2 does not combine with {key}"):
        orch(**kw)
    assert orch(**kw, extend_flat_groups=0).extend_flat_groups == 0


def test_extend_accepts_the_default_advantage_with_any_scale():
    for scale in ("none", "group", "batch"):
        assert orch(advantage={"scale_rewards": scale}, dynamic_sampling=True).extend_flat_groups == 2
