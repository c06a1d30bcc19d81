"""Real vLLM renders orch `client.chat_template_kwargs`: a copy of the bundled model whose chat template reads
`enable_thinking` (as Qwen3's does), served by `tidal grpo-infer`; `VllmClient.tokenize_chat` with and
without the kwarg gives the ids the tokenizer renders with and without it (slow: a server of its own, ~30 s)."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from tests.conftest import free_port, kill_group, tidal, wait_healthy
from tidal.config.orch import ClientSection
from tidal.inference.backends.vllm.client import VllmClient
from tidal.models.sources import bundled

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "abc def"}]


def test_vllm_tokenize_applies_the_client_kwargs(tmp_path):
    from tests.unit.test_chat_template_kwargs import NO_THINKING, THINKING_TEMPLATE
    from tidal.trainer.model.load import load_tokenizer
    from tidal.trainer.sft import render_prompt

    model = tmp_path / "thinking-model"
    shutil.copytree(bundled("tidal:tiny-reverse"), model)
    (model / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    tok = load_tokenizer(str(model))
    port = free_port()
    with open(tmp_path / "infer.log", "w") as log:
        proc = tidal("grpo-infer", "--infer.model", str(model), "--infer.port", str(port), stdout=log)
        try:
            wait_healthy(port, proc)

            async def ids(kwargs: dict | None) -> list[int]:
                client = VllmClient(ClientSection(base_url=[f"http://127.0.0.1:{port}/v1"],
                                                       chat_template_kwargs=kwargs or {}))
                try:
                    return await client.tokenize_chat(str(model), MESSAGES)
                finally:
                    await client.close()

            plain, no_think = asyncio.run(ids(None)), asyncio.run(ids(NO_THINKING))
        finally:
            kill_group(proc)
    assert plain == render_prompt(tok, MESSAGES) and no_think == render_prompt(tok, MESSAGES, NO_THINKING)
    assert plain != no_think
