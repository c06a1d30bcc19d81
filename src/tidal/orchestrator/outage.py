"""Environment failures vs model failures, and environment outages.

A rollout whose environment failed on its own side was never judged: its OpenEnv server refused the connection,
answered a server error or timed out, a `tidal env-server` did the same, or a reward function (an environment's
scoring, a tool) raised `tidal.rewards.ServiceUnavailable` for a service it depends on. Such a rollout carries
`Completion.env_error`; a reward of `reward_default` there would read as "bad answer" and push the policy away
from completions nobody judged. So:
- it carries no loss (its loss mask is cleared in the batch) and stays out of its group's baseline and std
  (`advantage.group_advantages(judged=...)`); its advantage is 0 (`env/failed` counts them per step);
- a group left with fewer than 2 judged rollouts (1 when `rollouts_per_example` is 1) has no baseline and is
  dropped (`env/dropped_groups`);
- a step where at least `env_outage.fraction` of the rollouts failed so, or whose every group was dropped, is an
  outage (`EnvFailures.is_outage`): nothing of it is trained on. `Outage.wait` says so once (what failed, where),
  waits with backoff (1 s doubling to 30 s) until the environments answer (`probe`: an OpenEnv server's
  `/health`, a `tidal env-server`'s `/info`; a reward function's service has no probe: the step is simply tried
  again after the wait), and the step is sampled again with the same examples; past `env_outage.timeout_s` from
  the outage's first failed step the run stops with `EnvOutage` naming the environment (`env/outage_waits` counts
  the waits of a step). In-flight mode applies the rule per group (`stream`): a group that was an outage is
  waited out and sampled again, never trained on. One `Outage` per run, shared by every step or group waiting.
- the outage ends when a step (group) is judged again, i.e. is no outage (`Outage.settle`), even if a few of its
  rollouts failed below `env_outage.fraction`: the next outage then starts its own clock. A probe that answers
  only ends the wait (the step is sampled again); it does not end the outage, since the probe cannot judge a
  rollout (a reward function's service has no probe at all): an environment whose health check answers while its
  rollouts keep failing still stops the run after `env_outage.timeout_s`.
The model's own doing is not an environment failure: an invalid action, a wrong answer, code the model wrote that
crashes or hangs in a sandbox all score as before (`reward_default` where a reward function raised).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tidal.config.orch import EnvOutageSection
from tidal.inference.protocol import Completion

log = logging.getLogger("tidal.orch")

BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0


class EnvOutage(TimeoutError):
    """An environment outage outlasted `env_outage.timeout_s`: the run stops (nothing was trained on it). A
    TimeoutError, so `tidal grpo-orch` stops with its message (exit 1), as for a policy that never came."""


def judged(comps: Sequence[Completion]) -> np.ndarray:
    """(G,) True where the environment judged the rollout (no `env_error`)."""
    return np.array([c.env_error is None for c in comps], dtype=bool)


def keeps_group(judged_mask: np.ndarray) -> bool:
    """Whether a group keeps a baseline: at least 2 judged rollouts (all of a group of 1)."""
    return int(judged_mask.sum()) >= min(2, judged_mask.size)


@dataclass
class EnvFailures:
    """The environment failures among the groups scored for one step (or one in-flight batch)."""

    rollouts: int = 0
    failed: int = 0
    dropped_groups: int = 0
    kept_groups: int = 0
    first: str | None = None
    """The first failure's reason (names the environment and where it runs)."""

    def add(self, comps: Sequence[Completion]) -> bool:
        """Count one scored group; whether it is kept (`keeps_group`)."""
        mask = judged(comps)
        self.rollouts += mask.size
        self.failed += int((~mask).sum())
        if self.first is None and not mask.all():
            self.first = next(c.env_error for c in comps if c.env_error is not None)
        keep = keeps_group(mask)
        self.kept_groups += keep
        self.dropped_groups += not keep
        return keep

    def is_outage(self, fraction: float) -> bool:
        """At least `fraction` of the rollouts failed on the environment's side, or every group was dropped."""
        return self.failed > 0 and (self.failed >= fraction * self.rollouts or self.kept_groups == 0)

    def describe(self) -> str:
        return (f"{self.failed} of {self.rollouts} rollouts failed on the environment's side "
                f"({(self.first or '')[:500]})")


def probe(env: Any) -> str | None:
    """Why an environment (or each of an `EnvMix`'s) cannot be reached now, or None when all answer (or have
    nothing to ask: `Environment.unavailable`)."""
    for e in (env.envs.values() if hasattr(env, "envs") else [env]):
        why = e.unavailable()
        if why is not None:
            return str(why)
    return None


class Outage:
    """One run's environment outage, shared by every step or group that waits on it: `wait` while it lasts,
    `clear` once a step (group) is judged again.

    Any number of waiters share it safely: one backs off and probes at a time (a lock), so the backoff grows once
    per probe of the outage, not once per waiter; a probe that finds the environments back, or a `clear` by a group
    that finished meanwhile, releases every waiter at once; a waiter never reads the start of an outage another
    one cleared."""

    def __init__(self, section: EnvOutageSection, env: Any,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.section, self.env, self.sleep, self.clock = section, env, sleep, clock
        self.since: float | None = None
        """When the outage began (its first failed step); None: no outage."""
        self.delay = BACKOFF_START_S
        """The next backoff wait of this outage (doubles per probe)."""
        self.waits = 0
        """Backoff waits so far (all outages)."""
        self.waiting = 0
        """Callers inside `wait` now (the in-flight launcher starts no group meanwhile)."""
        self.answered = 0
        """Probes that found the environments back, and clears (all outages): a waiter that sees it grow returns."""
        self._turn = asyncio.Lock()

    async def wait(self, what: str) -> None:
        """Wait out the outage whose latest evidence is `what` (a step's or group's failures): says so at the
        outage's first call, then backs off until the environments answer `probe` (or another waiter's group
        clears the outage); EnvOutage once the outage has lasted `env_outage.timeout_s`."""
        timeout = self.section.timeout_s
        if self.since is None:
            self.since, self.delay = self.clock(), BACKOFF_START_S
            log.warning("environment outage: %s. Nothing is trained on it: waiting for the environment (backoff "
                        "%g s doubling to %g s), then sampling again, for up to %g s (env_outage.timeout_s)",
                        what, BACKOFF_START_S, BACKOFF_MAX_S, timeout)
        since, seen = self.since, self.answered
        self.waiting += 1
        try:
            while True:
                async with self._turn:  # one waiter backs off and probes at a time
                    if self.answered != seen or self.since != since:
                        return  # the environments answered, or the outage was cleared, while this one queued
                    elapsed = self.clock() - since
                    if elapsed >= timeout:
                        raise EnvOutage(f"environment outage for {elapsed:.0f} s, longer than env_outage.timeout_s "
                                        f"{timeout:g}: {what}. Stopping; no optimizer step was taken on the outage "
                                        f"(bring the environment back and resume from the last checkpoint)")
                    await self.sleep(min(self.delay, timeout - elapsed))
                    self.delay = min(2 * self.delay, BACKOFF_MAX_S)
                    self.waits += 1
                    if self.answered != seen or self.since != since:
                        return  # cleared during the sleep
                    why = await asyncio.to_thread(probe, self.env)
                    if why is None:
                        self.answered += 1
                        return
                    what = f"still unavailable: {why}"
        finally:
            self.waiting -= 1

    def settle(self, failures: EnvFailures) -> bool:
        """Judge a scored step (group) by its `failures`: True when it is an outage (the caller waits and samples it
        again); otherwise the outage, if any, is over (`clear`), whether or not a few of its rollouts failed."""
        if failures.is_outage(self.section.fraction):
            return True
        self.clear()
        return False

    def clear(self) -> None:
        """A step (group) was judged again: the outage, if any, is over (its waiters return)."""
        if self.since is not None:
            log.warning("environment outage over after %.0f s; sampling goes on", self.clock() - self.since)
            self.since = None
            self.answered += 1
