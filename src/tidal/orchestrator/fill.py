"""The batch filler both rollout modes feed: judge -> keep or spare -> top up -> teacher, and the retries.

The gated mode (`collect`) samples a batch in rounds; the in-flight stream (`stream`) hands over finished groups one
by one. Both give every scored group to one `Filler`, which decides alike:
- **judge**: a group the environment left with fewer than 2 judged rollouts is dropped (`outage.EnvFailures`,
  `env/dropped_groups`); the others go to the group filters (`Buffer.judge`: `dynamic_sampling`,
  `buffer.online_difficulty_filtering`), which update the difficulty pools;
- **keep or spare**: accepted groups fill the batch, rejected ones are kept aside (`buffer/dropped_groups`);
- **rounds**: a round asks for `oversampling_factor` x the groups still missing (with group filters; without them
  the groups still missing, which are only missing when the environment dropped some). `buffer/rounds` counts the
  rounds a batch needed in both modes: the gated mode samples each round at once, the in-flight stream opens the
  next round when the groups of the previous one are all judged;
- **top up**: after `max_sampling_rounds` rounds a short batch is filled with rejected groups
  (`buffer/filled_with_dropped`); the in-flight stream then takes every further group until the batch is full, a
  gated batch still short (groups dropped for environment failures, no rejected ones to fill with) goes out short,
  counted in `env/short_groups` and said once per run;
- **teacher**: with orch `teacher`, its logprobs of every chosen sequence (`with_teacher`).

`Retries` is the one rule for failed inference requests (a server died or restarted), whoever sent them: wait for
the server(s) to answer, have the policy loaded again, try again; the `MAX_ATTEMPTS`th failure in a row stops the
run.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

import numpy as np

from tidal.config.orch import OrchConfig
from tidal.envs.base import Example
from tidal.inference.protocol import Completion, InferenceClient, InferenceError
from tidal.orchestrator.advantage import combine_rewards
from tidal.orchestrator.buffer import Buffer
from tidal.orchestrator.groups import Collected, Pool, StepSample, teacher_logprobs
from tidal.orchestrator.outage import judged
from tidal.orchestrator.policy import PolicyTracker

log = logging.getLogger("tidal.orch")

MAX_ATTEMPTS = 5
_SAID: set[str] = set()
"""Warnings said once per process (one orchestrator runs per process)."""


class Filler:
    """One batch being filled (module doc): `next_round`, `offer` each scored group, `top_up`; `kept` is the batch."""

    def __init__(self, cfg: OrchConfig, buffer: Buffer, weights: Sequence[float]) -> None:
        """`weights`: the reward functions' weights (`Scorer.weights`)."""
        self.need = cfg.batch_size // cfg.rollouts_per_example
        self.factor = cfg.oversampling_factor if buffer.filtering else 1.0
        self.max_rounds = cfg.max_sampling_rounds
        self.buffer, self.weights = buffer, weights
        self.kept, self.spare = Collected(), Collected()
        self.rounds = 0
        self.asked = 0
        """Groups asked for in the rounds so far."""
        self.scored = 0
        """Groups offered so far (every scored group, dropped ones too)."""

    @property
    def missing(self) -> int:
        return max(0, self.need - len(self.kept.examples))

    @property
    def full(self) -> bool:
        return self.missing == 0

    @property
    def round_done(self) -> bool:
        """Every group asked for so far was offered."""
        return self.scored >= self.asked

    def next_round(self) -> int:
        """Open a round while the batch is short and rounds are left: the groups it asks for (0: none)."""
        if self.full or self.rounds >= self.max_rounds:
            return 0
        self.rounds += 1
        self.buffer.counts["buffer/rounds"] = float(self.rounds)
        ask = math.ceil(self.missing * self.factor)
        self.asked += ask
        return ask

    def offer(self, example: Example, prompt: list[int], group: list[Completion], scores: np.ndarray,
              images: list[bytes] | None = None, version: tuple[int, int] = (0, 0), pool: Pool | None = None) -> bool:
        """Judge one scored group and keep or spare it; whether it went into the batch. `pool`: the group was chosen
        from more completions (`extend`)."""
        self.scored += 1
        if not self.kept.env.add(group):  # fewer than 2 rollouts judged (the others failed on the environment's side)
            return False
        ok = self.buffer.judge(example, combine_rewards(scores, self.weights)[0][judged(group)])
        if not ok:
            self.buffer.counts["buffer/dropped_groups"] += 1
        keep = ok and not self.full
        (self.kept if keep else self.spare).add(example, prompt, group, scores, images, version, pool)
        return keep

    def top_up(self) -> None:
        """Fill a short batch with rejected groups (counted in `buffer/filled_with_dropped`)."""
        fill = min(self.missing, len(self.spare.examples))
        if fill:
            self.buffer.counts["buffer/filled_with_dropped"] += fill
            self.kept.extend(self.spare, fill)
        self.spare = Collected()  # all taken, or the batch is full

    def shortfall(self, counts: dict[str, float], what: str) -> None:
        """Count the groups a finished batch lacks (`env/short_groups`); the first time, say why."""
        counts["env/short_groups"] = float(self.missing)
        if self.missing and "short" not in _SAID:
            _SAID.add("short")
            log.warning("%s has %d of %d groups: %d group(s) were dropped for failures on the environment's side "
                        "and %d sampling round(s) (max_sampling_rounds) did not replace them; it is trained on as "
                        "it is (env/short_groups counts the missing groups of every batch; said once)",
                        what, len(self.kept.examples), self.need, self.kept.env.dropped_groups, self.rounds)


async def with_teacher(out: StepSample, cfg: OrchConfig, teacher: InferenceClient | None) -> StepSample:
    """`out` with orch `teacher`'s logprobs of every chosen sequence, when a teacher is configured."""
    if teacher is not None and cfg.teacher is not None:
        t1 = time.monotonic()
        out.teacher = await teacher_logprobs(teacher, cfg.teacher, out.collected)
        out.teacher_time_s = time.monotonic() - t1
    return out


class Retries:
    """Failed inference requests in a row of one task (module doc)."""

    def __init__(self, what: str, policy: PolicyTracker, *clients: InferenceClient | None) -> None:
        """`what`: named in the warning; `clients`: those to wait for (the servers, a teacher)."""
        self.what, self.policy, self.clients = what, policy, [c for c in clients if c is not None]
        self.failures = 0

    async def failed(self, exc: InferenceError, counts: dict[str, float] | None = None) -> None:
        """Raise `exc` at the `MAX_ATTEMPTS`th failure in a row; else wait for the servers, have the policy loaded
        again and count it (`inference_retries`)."""
        self.failures += 1
        if self.failures >= MAX_ATTEMPTS:
            raise exc
        log.warning("%s: inference request failed (%s); waiting for the server, then retrying (attempt %d of %d)",
                    self.what, str(exc)[:300], self.failures + 1, MAX_ATTEMPTS)
        for c in self.clients:
            await c.wait_ready()
        self.policy.invalidate()
        if counts is not None:
            counts["inference_retries"] = counts.get("inference_retries", 0.0) + 1

    def ok(self) -> None:
        """A request went through: the count starts again."""
        self.failures = 0
