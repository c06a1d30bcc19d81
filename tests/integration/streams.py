"""What every `GroupStream` test against the shared vLLM server sets up: a client that waits for the server, policy 0
followed in the run directory, the stream started over the orch config's environments, and all of it closed again
whatever the test does (`open_stream`); `take_first` takes batch 1 and returns it with its counts and the stream.
`gated_batch` is the gated mode's counterpart: batch 1 sampled by `collect_groups` on policy 0."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tests.conftest import MODEL
from tidal.config.orch import ClientSection, OrchConfig
from tidal.inference.backends.vllm.client import VllmClient
from tidal.orchestrator.buffer import Buffer
from tidal.orchestrator.collect import collect_groups
from tidal.orchestrator.envmix import EnvMix
from tidal.orchestrator.groups import Collected
from tidal.orchestrator.policy import PolicyTracker
from tidal.orchestrator.scoring import Scorer
from tidal.orchestrator.stream import GroupStream


@contextlib.asynccontextmanager
async def open_stream(vllm_server: str, cfg: OrchConfig, seed: int, run_dir: Path, *, env: EnvMix | None = None,
                      policy_dir: str = "default") -> AsyncIterator[GroupStream]:
    """A started `GroupStream` on the server `vllm_server` (its client is `stream.client`), closed on exit.
    `env`: the environments, when the test prepares them (default: the config's); the buffer and scorer are the
    config's (`stream.buffer`, `stream.scorer`)."""
    env = env or EnvMix(cfg.env, cfg.buffer.env_ratios)
    client = VllmClient(ClientSection(base_url=[vllm_server]))
    try:
        await client.wait_ready()
        policy = PolicyTracker(client, MODEL, run_dir, policy_dir)
        stream = GroupStream(cfg, env, random.Random(seed), client, MODEL, policy, Scorer(env.envs, cfg),
                             Buffer(cfg.buffer, cfg.dynamic_sampling), None, 1)
        await stream.start()
        try:
            yield stream
        finally:
            await stream.close()
    finally:
        await client.close()


def take_first(vllm_server: str, cfg: OrchConfig, seed: int, run_dir: Path, *,
               env: EnvMix | None = None) -> tuple[Any, dict[str, float], GroupStream]:
    """Batch 1 of a fresh stream (`open_stream`), its counts, and the stream (closed)."""

    async def go() -> tuple[Any, dict[str, float], GroupStream]:
        async with open_stream(vllm_server, cfg, seed, run_dir, env=env) as stream:
            counts: dict[str, float] = {}
            return await stream.take(1, counts), counts, stream

    return asyncio.run(go())


def gated_batch(vllm_server: str, cfg: OrchConfig, run_dir: Path, counts: dict[str, float],
                ) -> tuple[Collected, Scorer, Buffer]:
    """Batch 1 of `cfg` in the gated mode (`collect_groups`, examples drawn with `random.Random(5)`) on policy 0 of
    the shared server; returns it with the scorer and the buffer that judged it (`counts` gets the step's counts)."""
    env, buffer = EnvMix(cfg.env, cfg.buffer.env_ratios), Buffer(cfg.buffer, cfg.dynamic_sampling)
    scorer = Scorer(env.envs, cfg)

    async def go() -> Collected:
        client = VllmClient(ClientSection(base_url=[vllm_server]))
        try:
            await client.wait_ready()
            policy = PolicyTracker(client, MODEL, run_dir, "default")
            buffer.new_step()
            return await collect_groups(1, cfg, env, random.Random(5), client, MODEL, policy, counts, scorer, buffer)
        finally:
            await client.close()

    return asyncio.run(go()), scorer, buffer
