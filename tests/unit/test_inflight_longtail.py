"""The in-flight stream under long-tailed completion lengths (issue 44): it counts the completions still running,
not whole groups, so a group that waits for its last long completion holds one slot and further groups start beside
it (over-provisioning), while the completions running never exceed `in_flight_groups` x `rollouts_per_example` and
a group starts only when its completions fit beside those running and the finished groups waiting. (A group's
finished completions count again once the whole group waits to be batched, so running + waiting may pass the cap
between two launches; vLLM's load never does.) A fake server: each request's completion takes a time proportional
to a length drawn from `reverse-text-longtail`'s law, with a few running to `max_tokens`."""

from __future__ import annotations

import asyncio
import random

import numpy as np

from tidal.config.orch import OrchConfig
from tidal.envs import make_env
from tidal.inference.protocol import Completion, InferenceError
from tidal.orchestrator.buffer import Buffer
from tidal.orchestrator.rollout import split_group
from tidal.orchestrator.stream import GroupStream

SEED = random.SystemRandom().randrange(2**31)
TOKEN_S = 0.0005


class LongTailServer:
    """`sample` answers after len x TOKEN_S; a request for n completions returns when its longest is done."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.running = self.peak = 0
        self.requests: list[int] = []

    async def tokenize_prompt(self, model, prompt, tools=None):
        return [1] * len(prompt[-1]["content"])

    async def sample(self, model, prompt_ids, n, max_tokens, temperature, seed=None, extra=None):
        self.requests.append(n)
        k = len(prompt_ids)
        lens = [max_tokens if k > 16 and self.rng.random() < 0.3 else k + 3 for _ in range(n)]
        self.running += n
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(max(lens) * TOKEN_S)
        finally:
            self.running -= n
        return [Completion([5] * m, [-0.1] * m, "x" * m, "stop") for m in lens]


class FakePolicy:
    step, pushed_timeout_s, model = 0, None, "m"

    def lease(self):
        return self.model, self.step

    def release(self, model):
        pass

    def end_version(self, start):
        return start

    async def drain_unloads(self):
        pass


class ZeroScorer:
    weights = np.ones(1)

    def score(self, ex, comps, step):
        return np.zeros((len(comps), 1))


def test_split_group_reports_each_completion_and_cancels_the_rest_on_a_failure():
    async def go() -> None:
        server, done = LongTailServer(SEED), []
        cfg = OrchConfig(sampling={"max_tokens": 64, "seed": 5})
        got = await split_group(server, "m", [1] * 20, 4, cfg.sampling, cfg.seq_len, 11, 1.0,
                                lambda: done.append(server.running))
        assert len(got) == 4 and server.requests == [1] * 4 and len(done) == 4
        assert done == sorted(done, reverse=True)  # each reported as it returned, while the others still ran

        class Failing(LongTailServer):
            async def sample(self, *a, **k):
                if len(self.requests) == 2:
                    self.requests.append(1)
                    raise InferenceError("gone")
                return await super().sample(*a, **k)

        bad, ended = Failing(SEED), []
        try:
            await split_group(bad, "m", [1] * 30, 5, cfg.sampling, cfg.seq_len, None, 1.0, lambda: ended.append(1))
        except InferenceError:
            pass
        else:
            raise AssertionError("the failed request must raise")
        assert len(ended) == 5 and bad.running == 0  # every request reported, none left running

    asyncio.run(go())


def longtail_stream(split: bool | None = None, seed: int = SEED) -> tuple[OrchConfig, LongTailServer, GroupStream]:
    """A stream of groups of 4 on the long-tail environment, 8 groups' worth in flight, over a `LongTailServer`."""
    cfg = OrchConfig(batch_size=32, rollouts_per_example=4, async_mode="in_flight", in_flight_groups=8,
                     in_flight_split=split, max_async_level=8, sampling={"max_tokens": 200},
                     env=[{"id": "reverse-text-longtail", "args": {"median": 8, "sigma": 1.25, "max_len": 150}}])
    env = make_env("reverse-text-longtail", cfg.env[0].args)
    server = LongTailServer(seed)
    stream = GroupStream(cfg, env, random.Random(seed), server, "m", FakePolicy(), ZeroScorer(),
                         Buffer(cfg.buffer, cfg.dynamic_sampling), None, 1)
    return cfg, server, stream


def take_batches(cfg: OrchConfig, stream: GroupStream, steps: int, seen: dict[str, int]) -> None:
    """Take `steps` full batches from `stream` while sampling, every TOKEN_S, the most groups and completions
    running at once into `seen`; then close it."""
    async def watch() -> None:
        while True:
            seen["groups"] = max(seen["groups"], len(stream.running))
            seen["running"] = max(seen["running"], stream.seqs_running)
            await asyncio.sleep(TOKEN_S)

    async def go() -> None:
        stream._tasks = [asyncio.create_task(stream._guard(stream._launch()))]
        watcher = asyncio.create_task(watch())
        try:
            for step in range(1, steps + 1):
                got = await stream.take(step, {})
                assert len(got.collected.examples) == cfg.batch_size // cfg.rollouts_per_example
        finally:
            watcher.cancel()
            await stream.close()
            await asyncio.gather(watcher, return_exceptions=True)

    asyncio.run(go())


def test_long_groups_hold_only_their_running_completions():
    most = 0
    for seed in (SEED, SEED + 1, SEED + 2):  # a draw without long completions early on over-provisions nothing
        cfg, server, stream = longtail_stream(seed=seed)
        n, cap = cfg.rollouts_per_example, 8
        seen = {"groups": 0, "running": 0, "at_launch": 0}
        launch = stream._wait_for_room

        async def counted_launch(stream=stream, launch=launch, seen=seen, n=n) -> None:
            # groups running: the count grows only at a launch, and the launcher comes here right after each one,
            # so this sees every peak; then running + waiting once a group has room, with the group's own n
            seen["groups"] = max(seen["groups"], len(stream.running))
            await launch()
            seen["at_launch"] = max(seen["at_launch"], stream.seqs_running + n * (len(stream.ready) + 1))

        stream._wait_for_room = counted_launch  # type: ignore[method-assign]
        take_batches(cfg, stream, 5, seen)
        assert server.peak <= cap * n and seen["running"] <= cap * n, (seed, server.peak, seen)
        assert 0 < seen["at_launch"] <= cap * n, (seed, seen)
        assert set(server.requests) == {1}  # single-turn text groups: one completion per request
        assert stream.seqs_running == 0
        most = max(most, seen["groups"])
    assert most > 8, (SEED, most)  # long groups held few slots: more groups ran at once than the cap


def test_groups_cancelled_at_any_point_give_back_every_slot():
    """`close` cancels groups wherever they are: not yet started (the launcher just created them), waiting on
    their requests, or between requests; the count of running completions returns to 0 each time."""
    async def go(split: bool | None, ticks: int) -> tuple[int, int]:
        _, _, stream = longtail_stream(split)
        stream._tasks = [asyncio.create_task(stream._guard(stream._launch()))]
        for _ in range(ticks):
            await asyncio.sleep(0)
        launched = stream.launched
        await stream.close()
        return launched, stream.seqs_running

    for split in (None, False):  # a request per completion, one per group
        got = {ticks: asyncio.run(go(split, ticks)) for ticks in (1, 2, 3, 4, 5, 8, 13, 40, 200)}
        assert all(left == 0 for _, left in got.values()), (SEED, split, got)
        assert sum(launched > 0 for launched, _ in got.values()) >= 5, (SEED, split, got)


def test_unsplit_groups_are_one_request_each_and_hold_their_slots_until_all_return():
    """`in_flight_split: false`: a single-turn group is one request for its n completions, counted whole until the
    request returns: vLLM's running completions stay within the cap, and fewer groups than the cap run at once."""
    cfg, server, stream = longtail_stream(split=False)
    seen = {"groups": 0, "running": 0}
    take_batches(cfg, stream, 3, seen)
    assert set(server.requests) == {4}, server.requests  # one request per group, n completions each
    assert server.peak <= 8 * 4 and seen["running"] <= 8 * 4, (SEED, server.peak, seen)
    assert 0 < seen["groups"] <= 8, (SEED, seen)
    assert stream.seqs_running == 0
