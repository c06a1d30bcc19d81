"""Partial rollouts (orch `partial_rollouts`, issue 52) without a server: the combinations refused with the keys
named (exit 2 through the CLI), the CPU co-location default that keeps groups split, and the `Switch`'s order of
events under a merged reload (no request runs while the weights change; every token keeps the version it was
sampled under). The real-vLLM checks are in tests/integration/test_partial_rollouts.py; the stream's sampler here
is a fake (tokens on a timer, a stop honoured between two tokens), the one thing vLLM cannot be made to show: the
exact instant weights change under a request."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys

import numpy as np
import pytest
from pydantic import ValidationError

from tidal.config.orch import OrchConfig, SamplingSection
from tidal.inference.protocol import Completion
from tidal.orchestrator.envmix import EnvMix
from tidal.orchestrator.partial import Switch, newest_version, partial_group, refuse_whole_group, token_staleness
from tidal.orchestrator.preflight import check_partial

BASE = {"async_mode": "in_flight", "partial_rollouts": "abort_resume"}


@pytest.mark.parametrize(("extra", "key"), [
    ({"async_mode": "gated"}, "async_mode"),
    ({"weight_broadcast": {"type": "nccl"}}, "weight_broadcast.type"),
    ({"client": {"backend": "sglang"}}, "client.backend"),
    ({"client": {"return_routed_experts": True}}, "client.return_routed_experts"),
    ({"in_flight_split": False}, "in_flight_split"),
])
def test_combinations_that_cannot_work_are_refused_naming_the_key(extra, key):
    with pytest.raises(ValidationError, match=rf"partial_rollouts: abort_resume.*{key}|{key}.*partial_rollouts"):
        OrchConfig.model_validate({**BASE, **extra})


def test_supported_combinations_validate():
    cfg = OrchConfig.model_validate({**BASE, "rollouts_per_example": 4, "batch_size": 8,
                                     "weight_broadcast": {"reload": "merged"},
                                     "teacher": {"model": "tidal:tiny-reverse", "base_url": "http://t:1/v1"}})
    assert cfg.partial_rollouts == "abort_resume" and cfg.in_flight_split is None


def test_multi_turn_and_tool_environments_combine_rollout_functions_are_refused_up_front():
    """Multi-turn and tool environments continue each model turn (tests/unit/test_partial_turns.py); a rollout
    function returns token rows tidal cannot map back to the requests that sampled them."""
    from tests.e2e.tool_env import ReverseTool
    from tidal.orchestrator.preflight import give_tools

    cfg = OrchConfig.model_validate({**BASE, "env": [{"id": "reverse-text"}, {"id": "calculator"}]})
    env = EnvMix(cfg.env, None)
    env.envs["reverse-text"].tooling = ReverseTool().tooling
    check_partial(cfg, env)  # a multi-turn and a tool environment: accepted
    give_tools(env.envs.values(), None, rollout_func=object())
    with pytest.raises(ValueError, match="abort_resume does not combine with env 'reverse-text'.*rollout function.*"
                                         "cannot map back"):
        check_partial(cfg, env)


def test_the_cli_exits_2_naming_the_keys():
    for flags, key in ((["--orch.partial_rollouts", "abort_resume"], "async_mode"),
                       (["--orch.async_mode", "in_flight", "--orch.partial_rollouts", "abort_resume",
                         "--orch.client.return_routed_experts", "true"], "client.return_routed_experts")):
        proc = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo", *flags, "--dry-run"], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "partial_rollouts" in proc.stderr and key in proc.stderr, proc.stderr[-2000:]


def test_cpu_co_location_keeps_partial_groups_split():
    from tests.unit.test_colocate import CPU2
    from tidal.colocate.derive import derive_colocate
    from tidal.config import InferConfig, TrainConfig

    tiny = "tidal:tiny-reverse"
    co = derive_colocate(TrainConfig(model=tiny), InferConfig(model=tiny), OrchConfig.model_validate(BASE), CPU2)
    assert co.orch.in_flight_split is True
    plain = derive_colocate(TrainConfig(model=tiny), InferConfig(model=tiny), OrchConfig(async_mode="in_flight"),
                            CPU2)
    assert plain.orch.in_flight_split is False


class Policy:
    """`PolicyTracker`'s lease surface; `load` changes the weights the fake server samples with."""

    def __init__(self) -> None:
        self.step, self.model, self.base_model, self.merged, self.weights = 1, "base", "base", True, 1

    def lease(self):
        return self.model, self.step

    def release(self, model):
        pass


class Server:
    """Samples one token every `tick` s with the weights loaded *now* (a token's logprob is -weights), honouring
    `stop` between two tokens; records every token's true policy."""

    def __init__(self, policy: Policy, tick: float) -> None:
        self.policy, self.tick, self.truth = policy, tick, []

    async def sample_stream(self, model, prompt_ids, max_tokens, temperature, stop, seed=None, extra=None,
                            until=None):
        ids, lps = [], []
        while len(ids) < max_tokens:
            if stop.is_set():
                return Completion(ids, lps, "", "interrupted")
            await asyncio.sleep(self.tick)
            if stop.is_set():  # aborted: this token never reaches the client
                return Completion(ids, lps, "", "interrupted")
            ids.append(len(prompt_ids) + len(ids))  # token = its position: continuations must line up
            lps.append(-float(self.policy.weights))
        return Completion(ids, lps, "", "length")

    async def detokenize(self, model, ids):
        return f"{len(ids)} tokens"


def test_merged_switch_stops_requests_before_the_weights_change():
    async def go():
        policy = Policy()
        server = Server(policy, 0.002)
        switch = Switch("abort_resume", policy, merged=True)
        sampling = SamplingSection(max_tokens=60)

        async def follower():
            for new in (2, 3):
                await asyncio.sleep(0.03)
                await switch.before_load()
                assert not switch.running, "a request still runs while the weights change"
                policy.weights = new  # the merged reload
                await asyncio.sleep(0.01)
                policy.step = new
                switch.after_load()

        f = asyncio.create_task(follower())
        comps = await partial_group(switch, server, [0, 0, 0], 3, sampling, 100, None, 1.0, lambda: None)
        await f
        return comps, switch

    comps, switch = asyncio.run(go())
    for c in comps:
        assert c.token_ids == list(range(3, 63)), "a continuation goes on from prompt + tokens so far"
        assert c.versions is not None and len(c.versions) == 60
        assert [-lp for lp in c.logprobs] == [float(v) for v in c.versions], "a token's version is its weights'"
        assert set(c.versions) == {1, 2, 3} and c.finish_reason == "length" and c.text == "60 tokens"
    assert switch.counts["partial/switches"] == 2 and switch.counts["partial/resumed_requests"] >= 6
    assert newest_version(comps, 1) == 3 and newest_version([Completion([1], [0.0], "", "stop")], 2) == 2


def test_lora_switch_moves_requests_to_the_new_adapter_once_loaded():
    async def go():
        policy = Policy()
        policy.merged, policy.model = False, "a-1"
        server = Server(policy, 0.002)
        switch = Switch("abort_resume", policy, merged=False)

        async def follower():
            await asyncio.sleep(0.03)
            await switch.before_load()  # LoRA: requests keep running while the adapter loads
            assert switch.running
            policy.model, policy.step, policy.weights = "a-2", 2, 2
            switch.after_load()

        f = asyncio.create_task(follower())
        c = (await partial_group(switch, server, [0], 1, SamplingSection(max_tokens=40, min_tokens=40), 100, 5, 1.0,
                                 lambda: None))[0]
        await f
        return c

    c = asyncio.run(go())
    assert c.versions is not None and set(c.versions) == {1, 2} and c.versions == sorted(c.versions)
    assert c.token_ids == list(range(1, 41))


def test_off_is_a_no_op():
    async def go():
        switch = Switch("off", Policy(), merged=True)
        await switch.before_load()
        switch.after_load()
        counts: dict[str, float] = {}
        switch.take_counts(counts, 1, [], [])
        return switch, counts

    switch, counts = asyncio.run(go())
    assert not switch.on and counts == {} and switch.open.is_set()


def test_token_staleness_against_a_direct_count():
    """Random groups of random lengths, versions and masks; the reference counts token by token in Python."""
    rng = random.Random(random.SystemRandom().randrange(2**31))
    step = rng.randrange(5, 12)
    groups, starts = [], []
    for _ in range(rng.randrange(1, 8)):
        start = rng.randrange(0, step)
        comps = []
        for _ in range(rng.randrange(1, 5)):
            n = rng.randrange(1, 40)
            versions = sorted(rng.randrange(start, step) for _ in range(n)) if rng.random() < 0.7 else None
            mask = [rng.randrange(2) for _ in range(n)] if rng.random() < 0.3 else None
            if mask is not None:
                mask[0] = 1
            comps.append(Completion(list(range(n)), [0.0] * n, "", "stop", mask=mask, versions=versions))
        groups.append(comps)
        starts.append(start)
    got = token_staleness(step, groups, starts)
    flat = [(c, s) for comps, s in zip(groups, starts, strict=True) for c in comps]

    def lags(c, s):
        return [max(0, step - 1 - (c.versions[i] if c.versions else s)) for i in range(len(c.token_ids))
                if c.mask is None or c.mask[i]]

    every = [x for c, s in flat for x in lags(c, s)]
    assert got["staleness/token_mean"] == pytest.approx(sum(every) / len(every), rel=1e-12)
    top = sorted(flat, key=lambda cs: -len(cs[0].token_ids))[:max(1, len(flat) // 10)]
    assert got["staleness/longest_decile"] == pytest.approx(
        sum(max(0, step - 1 - s) for _, s in top) / len(top), rel=1e-12)
    top_lags = [x for c, s in top for x in lags(c, s)]
    assert got["staleness/longest_decile_token_mean"] == pytest.approx(sum(top_lags) / len(top_lags), rel=1e-12)
    assert token_staleness(step, [], []) == {}


def test_a_group_sampled_whole_is_an_error_with_partial_rollouts_only():
    """Images are seen only when an example is drawn: such a group stops the run naming the key; so does a group a
    rollout function samples (refused up front too); a multi-turn or tool group goes on (its turns continue)."""
    class Env:
        id, rollout_func = "fn-env", None

    async def go():
        on, off = Switch("abort_resume", Policy(), merged=False), Switch("off", Policy(), merged=False)
        with pytest.raises(ValueError, match="partial_rollouts: abort_resume .* holds images"):
            refuse_whole_group(on, [b"png"], None)
        refuse_whole_group(off, [b"png"], None)  # off: sampled whole, as without partial rollouts
        refuse_whole_group(on, [], Env())  # a multi-turn / tool group: its turns continue across switches
        Env.rollout_func = object()
        with pytest.raises(ValueError, match="abort_resume does not combine with environment 'fn-env'"):
            refuse_whole_group(on, [], Env())

    asyncio.run(go())


def test_the_batch_carries_each_tokens_version(tmp_path):
    """`build_batch` writes `token_versions` (prompt tokens: the sample's start) when completions carry versions,
    and the file keeps them; without partial rollouts there is no such array."""
    from tidal.orchestrator.assemble import build_batch
    from tidal.transport.batch import TrainingBatch

    cfg = OrchConfig(batch_size=2, rollouts_per_example=2, max_off_policy_steps=8)
    g = [Completion([5, 6, 7], [-0.1] * 3, "", "stop", versions=[2, 2, 3]), Completion([8], [-0.2], "", "stop")]
    batch, _ = build_batch(4, [[1, 2]], [g], np.zeros(2), [np.zeros(3), np.zeros(1)], [(2, 3)], cfg)
    assert batch.token_versions is not None and batch.token_versions.tolist() == [2, 2, 2, 2, 3, 2, 2, 2]
    batch.save(tmp_path / "b.safetensors")
    assert TrainingBatch.load(tmp_path / "b.safetensors").token_versions.tolist() == batch.token_versions.tolist()
    plain, _ = build_batch(4, [[1, 2]], [[Completion([5], [-0.1], "", "stop")] * 2], np.zeros(2),
                           [np.zeros(1), np.zeros(1)], [(2, 2)], cfg)
    assert plain.token_versions is None
