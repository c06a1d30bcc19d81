"""Group filters against the real vLLM server: `dynamic_sampling` and `online_difficulty_filtering` drop
groups with no learning signal and sample replacements; `oversampling_factor` asks for more up front.

The reward: 1.0 for every completion of a prompt whose text has even length (a group with no signal), and
0/1 alternating for the others."""

from __future__ import annotations

import numpy as np
import pytest

from tests.integration.streams import gated_batch
from tidal.config.orch import OrchConfig
from tidal.orchestrator.advantage import combine_rewards

pytestmark = pytest.mark.vllm


def split_reward(prompts, completions, **_):
    even = len(prompts[0][-1]["content"]) % 2 == 0
    return [1.0 if even else float(i % 2) for i in range(len(completions))]


def collect(url: str, tmp_path, counts: dict[str, float] | None = None, **kw):
    cfg = OrchConfig.model_validate({
        "batch_size": 16, "rollouts_per_example": 4, "seq_len": 256, "sampling": {"max_tokens": 8},
        "env_reward_weight": 0.0,
        "reward_funcs": [{"import_path": "tests.integration.test_buffer_filters:split_reward"}],
        **kw})
    got, scorer, buffer = gated_batch(url, cfg, tmp_path, {} if counts is None else counts)
    stds = [float(np.std(combine_rewards(s, scorer.weights)[0])) for s in got.per_func]
    return got, stds, buffer.metrics()


@pytest.mark.parametrize("kw", [{"dynamic_sampling": True}, {"buffer": {"online_difficulty_filtering": True}}])
def test_filters_drop_groups_without_signal_and_refill(vllm_server, tmp_path, kw):
    got, stds, m = collect(vllm_server, tmp_path)
    assert len(got.groups) == 4 and min(stds) == 0.0, "unfiltered batches hold no-signal groups"
    got, stds, m = collect(vllm_server, tmp_path, **kw)
    assert len(got.groups) == 4 and min(stds) > 0, stds
    assert m["buffer/dropped_groups"] > 0 and m["buffer/rounds"] >= 2 and m["buffer/filled_with_dropped"] == 0
    assert all(len(g) == 4 for g in got.groups)


def test_oversampling_fills_the_batch_in_fewer_rounds(vllm_server, tmp_path):
    _, _, plain = collect(vllm_server, tmp_path, dynamic_sampling=True)
    got, stds, over = collect(vllm_server, tmp_path, dynamic_sampling=True, oversampling_factor=4.0)
    assert over["buffer/rounds"] == 1 < plain["buffer/rounds"] and min(stds) > 0 and len(got.groups) == 4


def test_a_batch_still_short_after_max_rounds_is_filled_with_dropped_groups(vllm_server, tmp_path):
    got, stds, m = collect(vllm_server, tmp_path, dynamic_sampling=True, max_sampling_rounds=1)
    assert len(got.groups) == 4 and m["buffer/rounds"] == 1
    assert m["buffer/filled_with_dropped"] == sum(s == 0.0 for s in stds) > 0


def judge_down_on_even(prompts, completions, **_):
    """A judge whose service is unavailable for prompts of even length (`ServiceUnavailable`: not judged)."""
    from tidal.rewards import ServiceUnavailable

    if len(prompts[0][-1]["content"]) % 2 == 0:
        raise ServiceUnavailable("LLM judge at http://judge:8000", "ConnectError: refused")
    return [float(i % 2) for i in range(len(completions))]


@pytest.mark.parametrize("rounds", [4, 1])
def test_groups_dropped_for_environment_failures_are_replaced_or_counted(vllm_server, tmp_path, rounds):
    """No group filter: a gated batch whose groups the environment dropped samples replacements in further rounds
    (up to `max_sampling_rounds`), and what is still missing is counted in `env/short_groups`."""
    counts: dict[str, float] = {}
    got, _, m = collect(vllm_server, tmp_path, counts=counts, max_sampling_rounds=rounds,
                        env_outage={"fraction": 1.0},
                        reward_funcs=[{"import_path": "tests.integration.test_buffer_filters:judge_down_on_even"}])
    assert got.env.dropped_groups > 0 and all(c.env_error is None for g in got.groups for c in g)
    assert len(got.groups) + counts["env/short_groups"] == 4
    assert 1 <= m["buffer/rounds"] <= rounds and m["buffer/filled_with_dropped"] == 0
    if rounds == 1:
        assert counts["env/short_groups"] == got.env.dropped_groups, "one round: every dropped group is missing"
    else:
        assert m["buffer/rounds"] >= 2 and len(got.groups) > 4 - got.env.dropped_groups, "replaced"
