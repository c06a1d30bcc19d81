"""Prompts that leave no room under `seq_len` are skipped (another example drawn) or truncated, and counted;
tokenized by the real vLLM server."""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.conftest import MODEL
from tidal.config.orch import ClientSection, OrchConfig
from tidal.envs import make_env
from tidal.inference.backends.vllm.client import VllmClient
from tidal.orchestrator.groups import draw_prompts

pytestmark = pytest.mark.vllm


def draw(url: str, cfg: OrchConfig, n: int) -> tuple[list, list[list[int]], dict, list[list[int]]]:
    env = make_env("reverse-text", {})

    async def go():
        client = VllmClient(ClientSection(base_url=[url]))
        try:
            await client.wait_ready()
            counts = {"prompts/skipped": 0.0, "prompts/truncated": 0.0}
            examples, prompts = await draw_prompts(env, random.Random(3), client, MODEL, n, cfg, counts)
            full = [await client.tokenize_chat(MODEL, ex.prompt) for ex in examples]
            return examples, prompts, counts, full
        finally:
            await client.close()

    return asyncio.run(go())


def test_long_prompts_are_skipped_or_truncated_and_counted(vllm_server):
    _, _, _, natural = draw(vllm_server, OrchConfig(seq_len=4096), 24)
    lengths = sorted(len(p) for p in natural)
    seq_len = lengths[len(lengths) // 2]  # about half the prompts leave no room
    assert 16 < lengths[0] < seq_len <= lengths[-1]

    _, prompts, counts, full = draw(vllm_server, OrchConfig(seq_len=seq_len, long_prompts="skip"), 24)
    assert counts["prompts/skipped"] > 0 and counts["prompts/truncated"] == 0
    assert all(len(p) < seq_len for p in prompts) and prompts == full  # kept prompts are whole

    cfg = OrchConfig(seq_len=seq_len, long_prompts="truncate", sampling={"max_tokens": 8})
    _, prompts, counts, full = draw(vllm_server, cfg, 24)
    assert counts["prompts/truncated"] == sum(len(p) >= seq_len for p in full) > 0
    assert counts["prompts/skipped"] == 0
    for p, f in zip(prompts, full, strict=True):
        if len(f) >= seq_len:
            assert p == f[-(seq_len - 8):], "the end of the prompt (the generation prompt) is kept"
        else:
            assert p == f

    with pytest.raises(ValueError, match="longer than seq_len .* long_prompts: truncate"):
        draw(vllm_server, OrchConfig(seq_len=16), 4)  # no prompt fits in 16 tokens
