"""`sampling.min_tokens`, `sampling.repetition_penalty` and `sampling.temp_scheduler` reach the real vLLM
server (each test fails when the key is ignored)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.conftest import MODEL
from tidal.config.orch import ClientSection, OrchConfig
from tidal.inference.backends.vllm.client import VllmClient
from tidal.inference.protocol import Completion
from tidal.orchestrator.assemble import build_batch
from tidal.orchestrator.rollout import rollout_group
from tidal.orchestrator.sampling import temperature_at

pytestmark = pytest.mark.vllm

MESSAGES = [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": "hi there"}]


def rollouts(url: str, cfg: OrchConfig, temperature: float | None = None) -> list[Completion]:
    async def go():
        client = VllmClient(ClientSection(base_url=[url]))
        try:
            await client.wait_ready()
            prompt = await client.tokenize_chat(MODEL, MESSAGES)
            return await rollout_group(client, MODEL, prompt, 16, cfg.sampling, cfg.seq_len, seed=11,
                                       temperature=temperature)
        finally:
            await client.close()

    return asyncio.run(go())


def test_min_tokens_holds_back_eos(vllm_server):
    free = rollouts(vllm_server, OrchConfig(seq_len=256, sampling={"max_tokens": 40}))
    shortest = min(len(c.token_ids) for c in free)
    assert shortest < 30, "the model stops early on its own"
    held = rollouts(vllm_server, OrchConfig(seq_len=256, sampling={"max_tokens": 40, "min_tokens": shortest + 5}))
    assert min(len(c.token_ids) for c in held) >= shortest + 5


def test_repetition_penalty_changes_the_sampled_distribution(vllm_server):
    plain = rollouts(vllm_server, OrchConfig(seq_len=256, sampling={"max_tokens": 30}))
    penal = rollouts(vllm_server, OrchConfig(seq_len=256, sampling={"max_tokens": 30, "repetition_penalty": 3.0}))
    assert [c.token_ids for c in plain] != [c.token_ids for c in penal]
    # same seed: the first token is sampled from the same logits unless the penalty applies (prompt tokens
    # count as seen), so the reported logprobs of the penalized run differ
    assert not np.allclose([c.logprobs[0] for c in plain], [c.logprobs[0] for c in penal])


def test_scheduled_temperature_is_sent_and_carried_by_the_batch(vllm_server):
    cfg = OrchConfig(seq_len=256, max_steps=5, batch_size=16, rollouts_per_example=16,
                     sampling={"max_tokens": 20, "temp_scheduler": {"type": "linear", "start_temperature": 1.5,
                                                                    "end_temperature": 0.25}})
    hot, cold = rollouts(vllm_server, cfg, temperature_at(cfg.sampling, cfg.max_steps, 1)), rollouts(
        vllm_server, cfg, temperature_at(cfg.sampling, cfg.max_steps, 5))
    # a colder temperature concentrates mass: sampled tokens get higher logprobs on average
    assert np.mean([lp for c in cold for lp in c.logprobs]) > np.mean([lp for c in hot for lp in c.logprobs]) + 0.1
    rewards = np.zeros(16)
    batch, metrics = build_batch(5, [[1, 2]], [cold], rewards, [np.zeros(len(c.token_ids)) for c in cold], 4, cfg)
    assert batch.temperature == metrics["temperature"] == 0.25


def test_elastic_pool_is_discovered_through_dns(vllm_server):
    """`client.elastic`: the servers come from resolving the hostname (the default base_url, port 8000, is not
    listening, so ignoring the key would fail)."""
    port = int(vllm_server.rsplit(":", 1)[1].split("/")[0])

    async def go():
        client = VllmClient(ClientSection(connect_timeout_s=5, elastic={"hostname": "localhost", "port": port,
                                                                              "sync_interval": 0.1}))
        try:
            models = await client.wait_ready()
            prompt = await client.tokenize_chat(MODEL, MESSAGES)
            comps = await client.sample(MODEL, prompt, 2, 4, 1.0)
            await asyncio.sleep(0.2)
            changed = await client.discover()
            return models, comps, client.urls, changed
        finally:
            await client.close()

    models, comps, urls, changed = asyncio.run(go())
    assert MODEL in models and len(comps) == 2 and urls == [f"http://127.0.0.1:{port}/v1"] and changed is False
