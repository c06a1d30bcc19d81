"""Bad input, with real vLLM serving the bundled text-only model: a prompt with an image is a clear error that
names the model and the example (not retried, not dropped silently)."""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.conftest import MODEL
from tests.e2e.vlm_env import SquareColour
from tidal.config.orch import ClientSection, OrchConfig
from tidal.inference.backends.vllm.client import VllmClient
from tidal.inference.protocol import NotMultimodal
from tidal.orchestrator.groups import draw_prompts

pytestmark = pytest.mark.vllm


def test_an_image_prompt_to_a_text_only_model_is_refused_by_name(vllm_server):
    async def go() -> None:
        client = VllmClient(ClientSection(base_url=[vllm_server]))
        try:
            await draw_prompts(SquareColour(), random.Random(0), client, MODEL, 2, OrchConfig(), {})
        finally:
            await client.close()

    with pytest.raises(NotMultimodal) as info:
        asyncio.run(go())
    msg = str(info.value)
    assert f"model '{MODEL}'" in msg and "takes text only" in msg and "1 image(s)" in msg
    assert "Which colour is the square?" in msg
