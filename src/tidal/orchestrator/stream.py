"""In-flight weight updates (`async_mode: in_flight`): a continuous stream of groups that never drains.

PipelineRL / AReaL style. Three asyncio tasks replace `collect.sample_step`'s per-batch gate:
- the **policy follower** loads each policy as soon as the trainer publishes it (`PolicyTracker.ensure`, every
  reload mode: LoRA adapters, merged reloads, nccl pushes) while requests keep running; new requests use the
  newest policy. A LoRA adapter still used by running requests is unloaded only when the last of them returns
  (`PolicyTracker.lease` / `release`); merged reloads and nccl pushes change the weights between two decoding
  steps of running requests (vLLM applies them between engine steps), so a request can span two policies;
- the **launcher** starts one group (one prompt, `rollouts_per_example` completions; multi-turn and tool
  environments run their loops) whenever its completions fit in `in_flight_groups` x `rollouts_per_example`
  beside the completions running and the finished groups waiting to be batched (with `in_flight_split` a
  single-turn group is sampled as one request per completion, so a group waiting for its last long completion
  holds one slot: over-provisioning under long-tailed lengths, vLLM's batch stays full; without it a group is one
  request holding all its slots until it returns; the completions running never exceed the cap, while
  running + waiting may pass it between two launches, when a group's finished completions count again as a
  waiting group), and the gate allows it: while batch n is being filled, a
  group starts only when the served policy is >= n - 1 - `max_async_level` (`staleness.launch_allowed`), the gated
  mode's bound applied per group;
- **`take(n)`** fills batch n from the finished groups in completion order: a group's staleness is
  (n - 1) - its start version; one above `max_off_policy_steps` is dropped whole (advantages stay valid; counted
  in `dropped_stale`; a finished group already stale for the batch being filled is dropped at once, freeing its
  slot) and the batch waits for fresh groups. Every other group goes to the filler both modes share
  (`fill.Filler`: environment judging, group filters, rounds, top-up, teacher), which opens its next round when
  the groups of the previous one are all judged.

Each group records `(start, end)`: the policy serving when its request(s) started and the newest policy that may
have reached them before they returned (LoRA: start == end; nccl: the servers' weight version at return; the
trainer's push pauses the servers with `mode=wait`, so running requests finish on the old weights and nccl
samples have start == end unless the push lands between two turns of a multi-turn rollout). The
logprobs are those vLLM reported while sampling, the true behaviour logprobs of each token.

Environment failures (`outage`) are judged per group: a group left with fewer than 2 judged rollouts is dropped
by the filler (counted), and a group mostly failed on the environment's side is an outage: it waits the
environment out with backoff (the run's one `Outage`, shared by every waiting group) while the launcher starts no
new group, then is sampled again (never trained on, as in gated mode); past `env_outage.timeout_s` the run stops.

Simplifications: a failed request (server restart) retries its own group with the policy loaded again, up to
`fill.MAX_ATTEMPTS` times in a row (`fill.Retries`); no example is in flight twice at once (the buffer's dedupe
covers the in-flight window, not exactly one batch); examples drawn ahead are not rewound at a checkpoint, so a
resumed run draws fresh ones. Not combined with `eval`, `sampling.temp_scheduler` or a teacher on a training
server (refused by the config).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from tidal.config.orch import OrchConfig
from tidal.envs.agent import AgentEnv
from tidal.envs.base import Example
from tidal.envs.images import prompt_images
from tidal.inference.protocol import Completion, InferenceClient, InferenceError
from tidal.orchestrator.buffer import Buffer, example_key
from tidal.orchestrator.envmix import EnvMix
from tidal.orchestrator.fill import Filler, Retries, with_teacher
from tidal.orchestrator.groups import StepSample, draw_prompts, group_rollouts, sample_seed
from tidal.orchestrator.outage import EnvFailures, Outage
from tidal.orchestrator.partial import PartialTurns, Switch, newest_version, partial_group, refuse_whole_group
from tidal.orchestrator.policy import PolicyTracker
from tidal.orchestrator.rollout import split_group
from tidal.orchestrator.sampling import temperature_at
from tidal.orchestrator.scoring import Scorer
from tidal.orchestrator.staleness import is_stale, launch_allowed
from tidal.rewards import ServiceUnavailable
from tidal.transport import weights

log = logging.getLogger("tidal.orch")

POLL_S = 0.05
DISCOVER_EVERY_S = 5.0


class Slots:
    """One group's completions counted in its stream's `seqs_running` until each returns. `free_all` (the group
    task's done callback) gives back whatever is still counted however the group ended: cancelled before it ran,
    failed before sampling, or cancelled mid-request."""

    def __init__(self, stream: GroupStream, n: int) -> None:
        self.stream, self.held = stream, 0
        self.take(n)

    def take(self, n: int) -> None:
        self.held += n
        self.stream.seqs_running += n

    def free(self, k: int = 1) -> None:
        k = min(k, self.held)
        self.held -= k
        self.stream.seqs_running -= k
        self.stream.changed.set()

    def free_all(self, _task: object = None) -> None:
        self.free(self.held)


@dataclass
class Group:
    """One finished, scored group and the policy versions that produced it."""

    example: Example
    prompt: list[int]
    completions: list[Completion]
    scores: np.ndarray
    images: list[bytes]
    version: tuple[int, int]


class GroupStream:
    """The in-flight sampler of one orchestrator (module doc); `start`, then `take(n)` per batch, `close`."""

    def __init__(self, cfg: OrchConfig, env: Any, rng: random.Random, client: InferenceClient, base: str,
                 policy: PolicyTracker, scorer: Scorer, buffer: Buffer, teacher: InferenceClient | None,
                 first_step: int, first_timeout_s: float | None = None, outage: Outage | None = None) -> None:
        """`outage`: the run's outage state (a fresh one when not given)."""
        self.cfg, self.env, self.rng, self.client, self.base = cfg, env, rng, client, base
        self.policy, self.scorer, self.buffer, self.teacher = policy, scorer, buffer, teacher
        self.need = cfg.batch_size // cfg.rollouts_per_example
        self.cap = cfg.in_flight_groups or 2 * self.need
        self.filling = first_step
        self.ready: deque[Group] = deque()
        self.running: set[asyncio.Task[None]] = set()
        self.seqs_running = 0  # completions requested and not yet returned (`_sample`)
        self.in_flight_keys: dict[str, int] = {}
        self.counts: dict[str, float] = {}
        self.gate_wait_s = 0.0
        self.launched = 0
        self.dropped = (0, 0)  # (samples, groups) dropped as stale since the last batch was taken
        self.error: BaseException | None = None
        self.changed = asyncio.Event()
        self.timeout_s = first_timeout_s or cfg.weights_timeout_s
        self._tasks: list[asyncio.Task[None]] = []
        self.outage = outage or Outage(cfg.env_outage, env)
        self._outage_waits = self.outage.waits
        # partial rollouts (orch partial_rollouts, orchestrator/partial.py): a no-op Switch when off
        self.partial = Switch(cfg.partial_rollouts, policy, cfg.partial_rollouts != "off" and policy.merged)

    # --- lifecycle -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the newest policy (>= the first batch's gate), then start the follower and the launcher."""
        await self.policy.ensure(max(0, self.filling - 1 - self.cfg.max_async_level), self.timeout_s)
        self.timeout_s = self.cfg.weights_timeout_s
        self._tasks = [asyncio.create_task(self._guard(self._follow())),
                       asyncio.create_task(self._guard(self._launch()))]

    async def close(self) -> None:
        """Cancel the follower, the launcher and the groups still running (their samples are not needed)."""
        tasks = [*self._tasks, *self.running]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.policy.drain_unloads()

    async def _guard(self, coro: Any) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to `take`, which raises it in the loop
            self._fail(exc)

    async def _wait_changed(self, timeout_s: float) -> None:
        """Until something changed (a group finished, a policy loaded, a batch was taken) or `timeout_s`.
        Not `asyncio.wait_for`: on Python 3.11 it swallows a cancellation that meets the event being set (as
        `close` does, cancelling groups), and the launcher would never stop."""
        self.changed.clear()
        waiter = asyncio.ensure_future(self.changed.wait())
        try:
            await asyncio.wait({waiter}, timeout=timeout_s)
        finally:
            waiter.cancel()

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.changed.set()

    # --- the policy follower ---------------------------------------------------------------------------------
    async def _follow(self) -> None:
        """Serve each newly published policy as soon as it appears (and again after a server restart)."""
        last_discover, retries = time.monotonic(), Retries("loading the newest policy", self.policy, self.client)
        while True:
            now = time.monotonic()
            try:
                if now - last_discover > DISCOVER_EVERY_S:
                    last_discover = now
                    if await self.client.discover():
                        self.policy.invalidate()  # servers joined the elastic pool: load the policy on all of them
                newest = weights.newest_policy(self.policy.run_dir)
                if (newest, weights.policy_stamp(self.policy.run_dir, newest)) != self.policy.loaded:
                    await self.partial.before_load()  # partial rollouts: merged weights change under no request
                    try:
                        await self.policy.ensure(0, self.cfg.weights_timeout_s)
                    finally:
                        self.partial.after_load()  # partial rollouts: running requests continue on the new policy
                    self.changed.set()
                retries.ok()
            except InferenceError as exc:  # a server died or restarted: load the policy again once it answers
                await retries.failed(exc)
            await asyncio.sleep(POLL_S)

    # --- the launcher ----------------------------------------------------------------------------------------
    async def _launch(self) -> None:
        while True:
            await self._wait_for_room()
            try:
                examples, prompts = await draw_prompts(self.env, self.rng, self.client, self.base, 1, self.cfg,
                                                       self.counts, self.buffer)
            except ServiceUnavailable as exc:  # an environment cannot draw examples: an outage
                await self.outage.wait(f"drawing an example failed: {exc}")
                continue
            ex, prompt = examples[0], prompts[0]
            key = example_key(ex, self.buffer.cfg.hash_keys)
            self.in_flight_keys[key] = self.in_flight_keys.get(key, 0) + 1
            slots = Slots(self, self.cfg.rollouts_per_example)  # counted down by `_sample` as each returns
            task = asyncio.create_task(self._group(ex, prompt, self.filling, self.launched, slots))
            self.launched += 1
            self.running.add(task)
            task.add_done_callback(slots.free_all)  # also for a task cancelled before it ran
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self.running.discard(task)
        self.changed.set()

    async def _wait_for_room(self) -> None:
        """Until a group's `rollouts_per_example` completions fit in `in_flight_groups` x `rollouts_per_example`
        beside the completions running and the finished groups waiting to be batched, and the gate lets one start.
        A group waiting for its last long completions holds only their slots (`_sample`): over-provisioning where
        lengths have a long tail, so vLLM's batch stays full."""
        gated_since: float | None = None
        n = self.cfg.rollouts_per_example
        while True:
            self._drop_stale()
            # a group's n completions fit beside those running and the finished groups waiting to be batched
            room = self.seqs_running + n * (len(self.ready) + 1) <= self.cap * n and not self.outage.waiting
            if room and launch_allowed(self.filling, self.policy.step, self.cfg.max_async_level):
                return
            now = time.monotonic()
            gated_since = (gated_since or now) if room else None  # blocked by the gate: waiting for a policy
            if gated_since is not None and now - gated_since > self.timeout_s:
                raise TimeoutError(f"policy {self.filling - 1 - self.cfg.max_async_level} was not served within "
                                   f"{self.timeout_s:.0f} s (weights_timeout_s); is the trainer running?")
            await self._wait_changed(POLL_S)
            if room:
                self.gate_wait_s += time.monotonic() - now

    async def _group(self, ex: Example, prompt: list[int], step: int, seq: int, slots: Slots) -> None:
        """Sample and score one group; a failed request retries it once the server answers again, a group that was
        an environment outage is waited out and sampled again (never trained on), as in gated mode. Every other
        scored group goes to the filler, env-dropped ones included (`fill.Filler.offer` judges them)."""
        images = prompt_images(ex.prompt)
        retries = Retries("in-flight group", self.policy, self.client)
        try:
            while True:
                comps, start, end = await self._attempt(step, ex, prompt, seq, images, slots, retries)
                scores = self.scorer.score(ex, comps, step)
                group = EnvFailures()
                group.add(comps)
                if not self.outage.settle(group):  # judged: the outage, if any, is over
                    break
                slots.free_all()
                await self.outage.wait(f"a group of batch {self.filling}: {group.describe()}")
            p = comps[0].prompt_ids or prompt  # an environment's reset observation changed the prompt
            self.ready.append(Group(ex, p, comps, scores, images, (start, end)))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to `take`
            self._fail(exc)

    async def _attempt(self, step: int, ex: Example, prompt: list[int], seq: int, images: list[bytes],
                       slots: Slots, retries: Retries) -> tuple[list[Completion], int, int]:
        """One group's completions and its (start, end) policy versions, retried after failed requests."""
        while True:
            model, start = self.policy.lease()
            slots.take(self.cfg.rollouts_per_example - slots.held)  # a failed or outage try gave its slots back
            try:
                comps = await self._sample(step, ex, prompt, seq, model, images, slots)
                # partial rollouts: a group's newest token's version (no request runs while weights change)
                end = newest_version(comps, start) if self.partial.on else self.policy.end_version(start)
                if self.policy.pushed_timeout_s is not None:  # nccl: a push may precede its publication
                    end = max(end, max((await self.client.weight_versions()).values(), default=end))
                return comps, start, end
            except InferenceError as exc:
                await retries.failed(exc, self.counts)
                while self.policy.loaded[0] < 0:  # the follower loads the policy again
                    await asyncio.sleep(POLL_S)
            finally:
                self.policy.release(model)

    async def _sample(self, step: int, ex: Example, prompt: list[int], seq: int, model: str,
                      images: list[bytes], slots: Slots) -> list[Completion]:
        """One group's completions, counted in `seqs_running` (`slots`) until each is done: a single-turn
        text group as `rollouts_per_example` requests of one completion (`rollout.split_group`), so a group that
        waits for its last long completions holds only their slots; other groups (multi-turn, tools, images, a
        rollout function's, an agent program's, and
        every group with orch `in_flight_split: false`) whole until they return. With partial rollouts every model
        turn (of a multi-turn or tool rollout too) is continued across policy switches."""
        n = self.cfg.rollouts_per_example
        env = self.env.env_of(ex) if isinstance(self.env, EnvMix) else self.env
        whole = (env.tooling is not None or env.rollout_func is not None or env.max_turns > 1
                 or isinstance(env, AgentEnv))
        temp = temperature_at(self.cfg.sampling, self.cfg.max_steps, step)
        if images or whole or self.cfg.in_flight_split is False:
            refuse_whole_group(self.partial, images, env)  # partial rollouts: no images, no rollout functions
            # partial rollouts: each model turn of a multi-turn / tool rollout continued across policy switches
            turns = PartialTurns(self.partial, self.client, temp) if self.partial.on else None
            try:
                return (await group_rollouts(step, self.cfg, self.env, self.client, model, [ex], [prompt], seq,
                                             [images], turns))[0]
            finally:
                slots.free(n)

        seed = sample_seed(self.cfg.sampling, step, seq * n)  # one index per completion
        if self.partial.on:  # partial rollouts: each completion continued across policy switches
            return await partial_group(self.partial, self.client, prompt, n, self.cfg.sampling, self.cfg.seq_len,
                                       seed, temp, slots.free)
        return await split_group(self.client, model, prompt, n, self.cfg.sampling, self.cfg.seq_len, seed, temp,
                                 slots.free)

    # --- the consumer ----------------------------------------------------------------------------------------
    def _drop_stale(self) -> None:
        """Drop the finished groups already too stale for the batch being filled (staleness only grows with
        the batch number, so they could never be used) and make room for fresh ones."""
        if not any(is_stale(self.filling, g.version[0], self.cfg.max_off_policy_steps) for g in self.ready):
            return
        keep: deque[Group] = deque()
        for g in self.ready:
            if is_stale(self.filling, g.version[0], self.cfg.max_off_policy_steps):
                self._forget(g.example)
                self.dropped = (self.dropped[0] + len(g.completions), self.dropped[1] + 1)
            else:
                keep.append(g)
        self.ready = keep

    def _forget(self, ex: Example) -> None:
        """A group left the in-flight window: its example may be drawn again."""
        key = example_key(ex, self.buffer.cfg.hash_keys)
        self.in_flight_keys[key] = self.in_flight_keys.get(key, 1) - 1
        if self.in_flight_keys[key] <= 0:
            del self.in_flight_keys[key]
            self.buffer.step_keys.discard(key)

    async def _next_group(self) -> Group:
        while not self.ready:
            if self.error is not None:
                raise self.error
            await self._wait_changed(1.0)
        if self.error is not None:
            raise self.error
        return self.ready.popleft()

    async def take(self, step: int, counts: dict[str, float]) -> StepSample:
        """Batch `step`'s groups: fresh enough, judged by the filler (`fill.Filler`: the gated mode's rounds, filters
        and top-up, with rounds opened as their groups finish); adds the stream's counts since the previous batch
        to `counts`."""
        t0, wait0 = time.monotonic(), self.gate_wait_s
        self.filling = step
        self.changed.set()
        self.buffer.new_step()
        self.buffer.step_keys = set(self.in_flight_keys)  # the dedupe set covers the in-flight window (module doc)
        filler = Filler(self.cfg, self.buffer, self.scorer.weights)
        filler.next_round()
        while not filler.full:
            g = await self._next_group()
            self._forget(g.example)
            if is_stale(step, g.version[0], self.cfg.max_off_policy_steps):
                self.dropped = (self.dropped[0] + len(g.completions), self.dropped[1] + 1)
                continue
            filler.offer(g.example, g.prompt, g.completions, g.scores, g.images, g.version)
            if filler.round_done and not filler.full and not filler.next_round():
                filler.top_up()  # rounds spent: rejected groups fill the batch, then every further group
        self.filling = step + 1
        self.changed.set()
        for k, v in self.counts.items():
            counts[k] = counts.get(k, 0.0) + v
        self.counts = {}
        counts["env/outage_waits"], self._outage_waits = self.outage.waits - self._outage_waits, self.outage.waits
        filler.shortfall(counts, f"batch {step}")  # 0: the stream fills every batch
        self.partial.take_counts(counts, step, filler.kept.groups, filler.kept.versions)  # partial rollouts
        dropped, self.dropped = self.dropped, (0, 0)
        if dropped[1]:
            log.info("batch %d: dropped %d group(s) staler than max_off_policy_steps %d", step, dropped[1],
                     self.cfg.max_off_policy_steps)
        out = StepSample(filler.kept, self.gate_wait_s - wait0, time.monotonic() - t0, dropped_stale=dropped)
        return await with_teacher(out, self.cfg, self.teacher)
