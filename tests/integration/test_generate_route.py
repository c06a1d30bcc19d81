"""vLLM's token-in/token-out `/inference/v1/generate` (the route router replay samples through,
`VllmClient.sample_generate`) on the tests' shared vLLM-CPU server of the bundled model (LoRA enabled, no adapter
asked for), started with `--enable-scale-out` (vLLM 0.32 serves the route behind it): `n` completions come back,
all of them, each with as many logprobs as token ids, logprobs equal to the trainer's, the text without the EOS
that stopped it. The text comes from vLLM's `/detokenize`, which keeps special tokens (it has no
`skip_special_tokens`): a special token sampled inside a completion stays in this path's text, where
`/v1/completions` drops it.

vLLM-CPU cannot return routes (`tidal.models.routes`), so the completions are read without them (`routes=False`).
vLLM 0.24 (CUDA) answered a request with `n` > 1 and the default output kind CUMULATIVE with fewer choices than
`n` (an H200 run: 89 rewards for groups of 16); 0.32 sets FINAL_ONLY itself for a non-streaming request, so this
server cannot show that defect: the client's `output_kind` FINAL_ONLY is checked in
tests/unit/test_short_groups.py, and here that 0.32 accepts it.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.conftest import MODEL
from tidal.config.orch import ClientSection
from tidal.inference.backends.vllm.client import VllmClient
from tidal.trainer.model.load import load_base_model, load_tokenizer
from tidal.trainer.step.logprobs import forward_logprobs

pytestmark = pytest.mark.vllm

N = 6
MESSAGES = [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": "tidal waves"}]


def test_generate_returns_all_n_completions(vllm_server):
    async def go():
        client = VllmClient(ClientSection(base_url=[vllm_server]))
        try:
            prompt = await client.tokenize_chat(MODEL, MESSAGES)
            return prompt, await client.sample_generate(MODEL, prompt, N, 40, 1.0, seed=7, routes=False)
        finally:
            await client.close()

    prompt, comps = asyncio.run(go())
    assert len(comps) == N
    tok = load_tokenizer(MODEL)
    model = load_base_model(MODEL, torch.device("cpu"), torch.float32).eval()
    for c in comps:
        assert len(c.token_ids) == len(c.logprobs) > 0 and c.routed_experts is None
        assert c.finish_reason in ("stop", "length")
        ids = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            ours = forward_logprobs(model, ids, torch.arange(ids.shape[1])[None], 1.0)[0, len(prompt):]
        assert float((ours - torch.tensor(c.logprobs)).abs().max()) < 1e-4
        shown = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == tok.eos_token_id
        assert c.text == tok.decode(shown, skip_special_tokens=False)  # /detokenize keeps special tokens
    assert len({tuple(c.token_ids) for c in comps}) > 1, "n completions at temperature 1 should differ"
