"""The one batch filler (`tidal.orchestrator.fill`): on fresh random group sequences, driving it as the gated mode
does gives what an independent loop of the gated rule gives (rounds, asks, kept and topped-up groups, env-dropped
groups, the shortfall), and the in-flight stream's `take` over the same sequence keeps the same groups with the
same `buffer/rounds` and `buffer/filled_with_dropped` (the two copies disagreed on `buffer/rounds`); `Retries` gives
up at the `MAX_ATTEMPTS`th failure in a row."""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections import deque

import numpy as np
import pytest

from tidal.config.orch import OrchConfig
from tidal.envs.base import Example
from tidal.inference.protocol import Completion, InferenceError
from tidal.orchestrator import fill
from tidal.orchestrator.buffer import Buffer
from tidal.orchestrator.fill import MAX_ATTEMPTS, Filler, Retries
from tidal.orchestrator.outage import EnvFailures, Outage
from tidal.orchestrator.partial import Switch
from tidal.orchestrator.stream import Group, GroupStream

SEED = random.SystemRandom().randrange(2**31)
K = 4  # rollouts_per_example


def make_group(i: int, kind: str, rng: random.Random) -> Group:
    """kind: 'ok' (rewards differ: kept by dynamic sampling), 'flat' (all equal: rejected), 'env' (3 of 4
    rollouts failed on the environment's side: dropped)."""
    comps = [Completion([rng.randrange(100)] * 2, [-0.5] * 2, "x", "stop") for _ in range(K)]
    rewards = [rng.random() for _ in range(K)] if kind == "ok" else [0.5] * K
    if kind == "env":
        for c in comps[1:]:
            c.env_error = "environment 'far' at http://h:1: HTTP 503"
    scores = np.array([[r if c.env_error is None else np.nan] for r, c in zip(rewards, comps, strict=True)])
    return Group(Example(prompt=f"p{i}", info={"kind": kind}), [1, 2], comps, scores, [], (0, 0))


def reference(groups: list[Group], need: int, factor: float, max_rounds: int, filtering: bool):
    """The gated rule as a plain loop: rounds ask ceil(missing x factor) (filters) or missing groups; env-dropped
    groups are skipped, rejected ones spared; after the rounds the batch is topped up with spared groups."""
    kept, spare, rounds, i = [], [], 0, 0
    while len(kept) < need and rounds < max_rounds:
        rounds += 1
        ask = math.ceil((need - len(kept)) * (factor if filtering else 1.0))
        for g in groups[i:i + ask]:
            kind = g.example.info["kind"]
            if kind == "env":
                continue
            (kept if (kind == "ok" or not filtering) and len(kept) < need else spare).append(g)
        i += ask
    filled = min(need - len(kept), len(spare))
    return kept + spare[:filled], rounds, filled, i


def random_case(rng: random.Random, filtering: bool):
    need = rng.randint(1, 6)
    factor = rng.choice([1.0, 1.5, 2.0, 3.0]) if filtering else 1.0
    cfg = OrchConfig(batch_size=need * K, rollouts_per_example=K, dynamic_sampling=filtering,
                     oversampling_factor=factor, max_sampling_rounds=rng.randint(1, 4))
    kinds = rng.choice([["ok", "flat", "env"], ["ok", "ok", "flat"], ["flat", "flat", "env"]])
    return cfg, [make_group(i, rng.choice(kinds), rng) for i in range(200)]


def kind_of(g: Group) -> str:
    return str(g.example.info["kind"])


def gated(cfg: OrchConfig, groups: list[Group]):
    buffer = Buffer(cfg.buffer, cfg.dynamic_sampling)
    buffer.new_step()
    filler, it = Filler(cfg, buffer, [1.0]), iter(groups)
    while ask := filler.next_round():
        for _ in range(ask):
            g = next(it)
            filler.offer(g.example, g.prompt, g.completions, g.scores, g.images, g.version)
    filler.top_up()
    return filler, buffer


@pytest.mark.parametrize("filtering", [True, False])
def test_gated_filling_follows_the_gated_rule_on_random_inputs(filtering):
    rng = random.Random(SEED)
    for _ in range(40):
        cfg, groups = random_case(rng, filtering)
        need = cfg.batch_size // K
        filler, buffer = gated(cfg, groups)
        kept, rounds, filled, asked = reference(groups, need, cfg.oversampling_factor, cfg.max_sampling_rounds,
                                                filtering)
        assert [e.prompt for e in filler.kept.examples] == [g.example.prompt for g in kept], SEED
        assert buffer.counts["buffer/rounds"] == rounds == filler.rounds and filler.asked == asked, SEED
        assert buffer.counts["buffer/filled_with_dropped"] == filled, SEED
        assert filler.kept.env.dropped_groups == sum(kind_of(g) == "env" for g in groups[:asked]), SEED
        assert filler.missing == need - len(kept), SEED


def fake_stream(cfg: OrchConfig, groups: list[Group]) -> GroupStream:
    class Scorer:
        weights = [1.0]

    s = GroupStream.__new__(GroupStream)
    s.cfg, s.scorer, s.buffer, s.teacher = cfg, Scorer(), Buffer(cfg.buffer, cfg.dynamic_sampling), None
    s.need, s.filling, s.error, s.counts, s.gate_wait_s = cfg.batch_size // K, 1, None, {}, 0.0
    s.in_flight_keys, s.changed, s.dropped = {}, asyncio.Event(), (0, 0)
    s.outage, s._outage_waits = Outage(cfg.env_outage, None), 0
    s.ready = deque(groups)
    s.partial = Switch("off", None, merged=False)  # partial rollouts off (tidal.orchestrator.partial)
    return s


def test_in_flight_take_keeps_what_the_gated_mode_keeps_on_random_inputs():
    rng = random.Random(SEED)
    for _ in range(40):
        filtering = rng.random() < 0.7
        cfg, groups = random_case(rng, filtering)
        need = cfg.batch_size // K
        filler, buffer = gated(cfg, groups)
        stream = fake_stream(cfg, groups)
        counts: dict[str, float] = {}
        got = asyncio.run(stream.take(1, counts))
        m = stream.buffer.counts
        streamed = [e.prompt for e in got.collected.examples]
        assert len(streamed) == need, SEED
        if filler.full:  # the same batch, the same rounds and top-up
            assert streamed == [e.prompt for e in filler.kept.examples], SEED
            assert m["buffer/rounds"] == buffer.counts["buffer/rounds"], SEED
            assert m["buffer/filled_with_dropped"] == buffer.counts["buffer/filled_with_dropped"], SEED
        else:  # gated goes out short; the stream takes further groups once the rounds are spent
            assert streamed[:len(filler.kept.examples)] == [e.prompt for e in filler.kept.examples], SEED
        assert counts["env/short_groups"] == 0, SEED


def test_a_short_gated_batch_is_counted_and_said_once(caplog):
    cfg = OrchConfig(batch_size=3 * K, rollouts_per_example=K, max_sampling_rounds=2)
    rng = random.Random(SEED)
    groups = [make_group(i, kind, rng) for i, kind in enumerate(["ok", "env", "env", "env", "env", "ok"])]
    fill._SAID.discard("short")
    with caplog.at_level(logging.WARNING, "tidal.orch"):
        for _ in range(2):
            filler, buffer = gated(cfg, groups)
            counts: dict[str, float] = {}
            filler.shortfall(counts, "batch 7")
            # round 1 asks 3 (1 kept, 2 env-dropped), round 2 asks the 2 missing (both env-dropped): 1 of 3
            assert counts["env/short_groups"] == 2 and buffer.counts["buffer/rounds"] == 2
            assert filler.kept.env.dropped_groups == 4
    assert caplog.text.count("batch 7 has 1 of 3 groups") == 1, "said once"
    full = Filler(cfg, Buffer(cfg.buffer), [1.0])
    full.next_round()
    for g in [groups[0], groups[5], make_group(6, "ok", rng)]:
        full.offer(g.example, g.prompt, g.completions, g.scores)
    counts = {}
    full.shortfall(counts, "batch 8")
    assert counts["env/short_groups"] == 0


def test_retries_give_up_at_max_attempts_and_reset_on_success():
    class Server:
        ready = 0

        async def wait_ready(self):
            self.ready += 1

    class Policy:
        invalidated = 0

        def invalidate(self):
            self.invalidated += 1

    server, policy = Server(), Policy()
    retries, counts = Retries("step 3", policy, server, None), {}  # type: ignore[arg-type]

    async def go():
        for _ in range(MAX_ATTEMPTS - 1):
            await retries.failed(InferenceError("connection refused"), counts)
        retries.ok()
        for _ in range(MAX_ATTEMPTS - 1):
            await retries.failed(InferenceError("connection refused"), counts)
        with pytest.raises(InferenceError, match="refused"):
            await retries.failed(InferenceError("connection refused"), counts)

    asyncio.run(go())
    assert server.ready == policy.invalidated == counts["inference_retries"] == 2 * (MAX_ATTEMPTS - 1)


def test_env_failures_of_a_batch_are_those_of_the_offered_groups():
    rng = random.Random(SEED)
    cfg = OrchConfig(batch_size=2 * K, rollouts_per_example=K)
    filler = Filler(cfg, Buffer(cfg.buffer), [1.0])
    filler.next_round()
    want = EnvFailures()
    for i, kind in enumerate(["env", "ok", "env", "ok"]):
        g = make_group(i, kind, rng)
        want.add(g.completions)
        filler.offer(g.example, g.prompt, g.completions, g.scores)
    assert (filler.kept.env.failed, filler.kept.env.dropped_groups) == (want.failed, want.dropped_groups) == (6, 2)
