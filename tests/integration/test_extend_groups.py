"""orch `extend_flat_groups` against the real vLLM server: a group whose rewards all agree gets more completions of
its prompt, trains on a choice that holds both rewards, and its advantages take the pool's mean as the baseline.

The reward (`first_flat`): every completion of a prompt's first scoring call scores 1.0 (a flat group); later calls
for the same prompt (the extension) score 0/1 alternating, so the pool of 4 + 4 holds six 1s and two 0s. `always_one`
never leaves a group flat-free."""

from __future__ import annotations

import numpy as np
import pytest

from tests.integration.streams import gated_batch
from tidal.config.orch import OrchConfig
from tidal.orchestrator.advantage import combine_rewards
from tidal.orchestrator.assemble import assemble
from tidal.orchestrator.filters import Filters
from tidal.orchestrator.groups import StepSample

pytestmark = pytest.mark.vllm

CALLS: dict[str, int] = {}


def first_flat(prompts, completions, **_):
    key = prompts[0][-1]["content"]
    CALLS[key] = CALLS.get(key, 0) + 1
    return [1.0] * len(completions) if CALLS[key] == 1 else [float(i % 2) for i in range(len(completions))]


def always_one(completions, **_):
    return [1.0] * len(completions)


def collect(url: str, tmp_path, reward: str, **kw):
    CALLS.clear()
    cfg = OrchConfig.model_validate({
        "batch_size": 8, "rollouts_per_example": 4, "seq_len": 256,
        "sampling": {"max_tokens": 8, "seed": 11}, "env_reward_weight": 0.0,
        "reward_funcs": [{"import_path": f"tests.integration.test_extend_groups:{reward}"}], **kw})
    counts: dict[str, float] = {}
    got, scorer, _ = gated_batch(url, cfg, tmp_path, counts)
    done = assemble(1, StepSample(got, 0.0, 1.0), cfg, scorer, Filters([], None), None)
    return got, counts, done, scorer


def test_a_flat_group_is_extended_and_trains_on_both_rewards_against_the_pool(vllm_server, tmp_path):
    plain, counts0, done0, _ = collect(vllm_server, tmp_path, "first_flat")
    assert counts0.get("extend/groups", 0) == 0 and all(p is None for p in plain.pools)
    assert all(np.abs(a).max() == 0 for a in done0.advantages), "without extension every group is flat"

    got, counts, done, scorer = collect(vllm_server, tmp_path, "first_flat", extend_flat_groups=2)
    assert counts["extend/groups"] == counts["extend/found_signal"] == 2
    assert counts["extend/completions"] == 8, "one round of 4 more completions per group found the signal"
    assert len(got.groups) == 2 and all(len(g) == 4 for g in got.groups)
    for scores, pool in zip(got.per_func, got.pools, strict=True):
        r = combine_rewards(scores, scorer.weights)[0]
        assert sorted(r.tolist()) == [0.0, 0.0, 1.0, 1.0], "both zeros of the pool, up to half the group"
        assert pool is not None and pool.size == 8 and pool.first_mean == 1.0
        assert pool.mean == pytest.approx(6 / 8) and pool.std == pytest.approx(np.std([1] * 6 + [0] * 2, ddof=1))
    adv = np.array([a[0] for a in done.advantages])
    rewards = done.rewards
    np.testing.assert_allclose(adv, rewards - 0.75, rtol=0, atol=1e-12)  # scale_rewards none, baseline 6/8
    assert done.batch.metrics["reward/sampled_mean"] == 1.0, "the policy's reward: the first draws'"
    assert done.batch.metrics["reward/mean"] == 0.5, "the trained completions'"


def test_a_group_still_flat_after_the_rounds_trains_on_its_first_draw(vllm_server, tmp_path):
    plain, _, _, _ = collect(vllm_server, tmp_path, "always_one")
    got, counts, done, _ = collect(vllm_server, tmp_path, "always_one", extend_flat_groups=2)
    assert counts["extend/groups"] == 2 and counts.get("extend/found_signal", 0) == 0
    assert counts["extend/completions"] == 2 * 2 * 4, "two rounds of 4 for each of the 2 groups"
    assert [[c.token_ids for c in g] for g in got.groups] == [[c.token_ids for c in g] for g in plain.groups]
    assert all(p is None for p in got.pools) and all(np.abs(a).max() == 0 for a in done.advantages)


def test_extension_draws_are_seeded(vllm_server, tmp_path):
    a, _, _, _ = collect(vllm_server, tmp_path, "first_flat", extend_flat_groups=1)
    b, _, _, _ = collect(vllm_server, tmp_path, "first_flat", extend_flat_groups=1)
    assert [[c.token_ids for c in g] for g in a.groups] == [[c.token_ids for c in g] for g in b.groups]
