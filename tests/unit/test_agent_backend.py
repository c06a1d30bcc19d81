"""The agent endpoint's sampling backend (`tidal.orchestrator.agentloop.ClientBackend`): its seeds and its renderings.

One seed rule for every multi-turn path (`tidal.orchestrator.rollout.turn_seed`): turn k of rollout i of a group
seeded `seed` is seeded `seed + 7919 k + i`. The tool loop samples a group's first turns as one vLLM request for `n`
completions, whose children vLLM seeds `seed + index`; the agent endpoint samples each session's call k as a request
of its own (`agentloop.ClientBackend`). With the same rule both draw the same tokens for the same conversation, which
is what makes bench/agent_overhead.py's two sides comparable row for row. The `n` sessions of a group share their
renderings: the same opening messages are rendered once, not `n` times."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tidal.config.orch import SamplingSection
from tidal.inference.protocol import Completion
from tidal.orchestrator.agentloop import ClientBackend
from tidal.orchestrator.rollout import Turns, turn_seed


def test_turn_zero_is_what_vllm_gives_the_children_of_one_seeded_request():
    pytest.importorskip("vllm")
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.parallel_sampling import ParentRequest

    parent = ParentRequest.__new__(ParentRequest)  # only the seed derivation is read (no engine request needed)
    parent.sampling_params, parent.cached_child_sampling_params = SamplingParams(n=8, seed=1234), None
    vllm_seeds = [parent._get_child_sampling_params(i).seed for i in range(8)]
    assert vllm_seeds == [turn_seed(1234, 0, i) for i in range(8)]
    assert turn_seed(None, 2, 3) is None


class Recording:
    """An inference client that records the seed of each request and answers one token; it renders a chat as one
    token per character of its messages' contents (a real rendering is tested with vLLM in
    tests/integration/test_agent_endpoint.py)."""

    def __init__(self) -> None:
        self.seeds: list[int | None] = []
        self.rendered: list[list[dict[str, Any]]] = []
        self.fail = False

    async def tokenize_chat(self, model: str, messages: list[dict[str, Any]], tools: Any = None,
                            add_generation_prompt: bool = True) -> list[int]:
        self.rendered.append(messages)
        await asyncio.sleep(0.01)  # the sessions ask at once, while the first rendering is under way
        if self.fail:
            raise RuntimeError("tokenize failed")
        return [ord(ch) for m in messages for ch in m["content"]]

    async def sample(self, model: str, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                     seed: int | None = None, extra: dict[str, Any] | None = None) -> list[Completion]:
        self.seeds.append(seed)
        return [Completion([5], [-0.5], "x", "stop", None) for _ in range(n)]


@pytest.mark.parametrize("seed", [None, 0, 40_000])
def test_the_endpoint_seeds_call_k_of_session_i_by_the_rule(seed):
    client = Recording()
    sampling = SamplingSection(max_tokens=8)

    async def go() -> None:
        for i in range(3):
            backend = ClientBackend(client, Turns(client, "m", 1.0), sampling, 1.0, seed, i)  # type: ignore[arg-type]
            for k in range(3):
                await backend.sample([1, 2, 3], 8, k, {})
            await backend.sample([1, 2, 3], 8, 3, {"temperature": 0.5})  # off-policy calls too

    asyncio.run(go())
    assert client.seeds == [turn_seed(seed, k, i) for i in range(3) for k in range(4)]
    if seed is not None:
        assert len(set(client.seeds)) == 12, "no two calls of a group share a seed"


def test_a_group_renders_the_same_opening_once():
    client = Recording()
    sampling = SamplingSection(max_tokens=8)
    a, b = [{"role": "user", "content": "hi"}], [{"role": "user", "content": "ho"}]

    async def go() -> list[list[int]]:
        renders: dict[str, Any] = {}
        group = [ClientBackend(client, Turns(client, "m", 1.0), sampling, 1.0, 0, i, renders)  # type: ignore[arg-type]
                 for i in range(8)]
        out = await asyncio.gather(*(g.render(a, None) for g in group), group[0].render(b, None))
        out[0].append(0)  # each session gets its own list
        other = ClientBackend(client, Turns(client, "m", 1.0), sampling, 1.0, 0, 0)  # type: ignore[arg-type]
        out.append(await other.render(a, None))  # another group renders for itself
        client.fail = True
        with pytest.raises(RuntimeError):
            await group[1].render([{"role": "user", "content": "x"}], None)
        client.fail = False
        out.append(await group[2].render([{"role": "user", "content": "x"}], None))  # a failure is not kept
        return out

    out = asyncio.run(go())
    assert client.rendered == [a, b, a, [{"role": "user", "content": "x"}], [{"role": "user", "content": "x"}]]
    assert out[1:8] == [[104, 105]] * 7 and out[0] == [104, 105, 0] and out[8] == [104, 111]
    assert out[9] == [104, 105] and out[10] == [120]
