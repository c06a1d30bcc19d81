"""Several environments in one run: which environment each example comes from (`buffer.env_ratios`).

Each `env[]` entry is an environment named by `name` (default: its id). Examples are assigned to
environments by smooth weighted round-robin on the normalized ratios (equal when `env_ratios` is null): the
environment whose count lags its target share the most goes next, so after n examples every environment's
count is within one of `n * ratio`, deterministically; the example itself is drawn from that environment with
the orchestrator's RNG. Every example carries its environment's name in `Example.task`, which routes its
scoring to that environment. The counters are part of the orchestrator's checkpoint.
"""

from __future__ import annotations

import random
from typing import Any

from tidal.config.environments import EnvSection
from tidal.envs import Environment, Example, make_env
from tidal.envs.tools import tooling_from_config


def build_env(e: EnvSection) -> Environment:
    """In process, in a spawned `tidal env-server` subprocess, or at a running server's `address`; with the
    section's `tools`, if any."""
    if e.address is not None or e.spawn:
        from tidal.envs.remote import RemoteEnvironment, spawn_server

        env: Environment = RemoteEnvironment(e.address or spawn_server(e.id, e.args))
    else:
        env = make_env(e.id, e.args)
    if e.tools is not None:
        t = e.tools
        env.tooling = tooling_from_config(t.functions, t.environment_factory, t.format, t.max_iterations)
    return env


class EnvMix:
    """The run's environments and the ratio-keeping example sampler."""

    def __init__(self, envs: list[EnvSection], ratios: list[float] | None = None) -> None:
        """orch `env` and `buffer.env_ratios` (None: equal shares)."""
        self.envs: dict[str, Environment] = {}
        for e in envs:
            env = build_env(e)
            self.envs[e.name or env.id or e.id] = env  # an import path is named by its class's `id`
        ratios = ratios or [1.0] * len(self.envs)
        total = float(sum(ratios))
        self.ratios = [r / total for r in ratios]
        self.counts = [0] * len(self.envs)

    @property
    def names(self) -> list[str]:
        return list(self.envs)

    def next_env(self) -> int:
        n = sum(self.counts) + 1
        i = max(range(len(self.ratios)), key=lambda k: (n * self.ratios[k] - self.counts[k], -k))
        self.counts[i] += 1
        return i

    def sample(self, rng: random.Random) -> Example:
        name = self.names[self.next_env()]
        ex = self.envs[name].sample(rng)
        ex.task = name
        return ex

    def env_of(self, example: Example) -> Environment:
        return self.envs.get(example.task) or next(iter(self.envs.values()))

    def take_metrics(self) -> dict[str, float]:
        """Counters the environments keep (`take_metrics`, e.g. the agent environment's `agent/*`) since the last
        call, summed over the environments that have them."""
        out: dict[str, float] = {}
        for e in self.envs.values():
            take = getattr(e, "take_metrics", None)
            for k, v in (take() if callable(take) else {}).items():
                out[k] = out.get(k, 0.0) + v
        return out

    def state(self) -> dict[str, Any]:
        return {"counts": dict(zip(self.names, self.counts, strict=True))}

    def load_state(self, state: dict[str, Any]) -> None:
        saved = state.get("counts", {})
        self.counts = [int(saved.get(name, 0)) for name in self.names]
