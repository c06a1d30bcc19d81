"""The agent endpoint's refusals over real HTTP with the real `openai` and `anthropic` SDKs (no model needed: each is
answered before anything is sampled): a wrong key 401, an unknown session 404, what breaks the sampling contract or
tidal does not do 400 naming it, a session past `max_calls` 429 and failed; `/v1/models` and the reward route."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tidal.envs.agent.server import AgentServer
from tidal.envs.agent.session import Session

MSGS = [{"role": "user", "content": "hi"}]


def with_session(probe: Any, max_calls: int = 4) -> tuple[Session, Any]:
    """Serve one session (no backend: nothing may be sampled) and run `probe(openai_url, anthropic_url, key)` in a
    thread; returns the session and what the probe returned."""
    async def go() -> tuple[Session, Any]:
        server = AgentServer("policy", "auto", 4)
        session = Session("s1", {}, max_calls, None, 256)
        await server.ensure_started()
        server.open(session, None)  # type: ignore[arg-type]
        try:
            return session, await asyncio.to_thread(probe, *server.urls(session), session.key)
        finally:
            await server.stop()

    return asyncio.run(go())


def status_of(call: Any) -> str:
    import anthropic
    import openai

    try:
        call()
    except (openai.APIStatusError, anthropic.APIStatusError) as exc:
        return f"{exc.status_code} {exc.message}"
    return "accepted"


def test_openai_sdk_is_refused_clearly():
    import openai

    def probe(url: str, _: str, key: str) -> list[str]:
        ok = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
        wrong = openai.OpenAI(base_url=url, api_key="wrong", max_retries=0)
        lost = openai.OpenAI(base_url=url.replace("/s/s1", "/s/nope"), api_key=key, max_retries=0)
        chat = ok.chat.completions.create
        out = [status_of(lambda: wrong.chat.completions.create(model="policy", messages=MSGS)),
               status_of(lambda: lost.chat.completions.create(model="policy", messages=MSGS)),
               status_of(lambda: chat(model="policy", messages=MSGS, n=2)),
               status_of(lambda: chat(model="policy", messages=MSGS, logit_bias={"5": 10})),
               status_of(lambda: chat(model="gpt-4o", messages=MSGS)),
               status_of(lambda: chat(model="policy", messages=MSGS, tool_choice="required",
                                      tools=[{"type": "function", "function": {"name": "f"}}])),
               status_of(lambda: chat(model="policy", messages=MSGS, presence_penalty=0.5)),
               status_of(lambda: chat(model="policy", messages=MSGS, parallel_tool_calls=False)),
               status_of(lambda: chat(model="policy", messages=[{"role": "user", "content": [
                   {"type": "image_url", "image_url": {"url": "data:,"}}]}])),
               status_of(lambda: chat(model="policy", messages=MSGS, seed=3))]
        assert [m.id for m in ok.models.list().data] == ["policy"]
        assert status_of(lambda: wrong.models.list()).startswith("401")
        return out

    session, got = with_session(probe)
    assert got[0].startswith("401") and "wrong API key" in got[0]
    assert got[1].startswith("404") and "no agent session 'nope'" in got[1]
    assert got[2].startswith("400") and "n=2" in got[2]
    assert got[3].startswith("400") and "logit_bias" in got[3]
    assert got[4].startswith("400") and "'gpt-4o' is not served" in got[4] and "'policy'" in got[4]
    assert got[5].startswith("400") and "tool_choice" in got[5]
    assert got[6].startswith("400") and "presence_penalty" in got[6]
    assert got[7].startswith("400") and "parallel_tool_calls" in got[7]
    assert got[8].startswith("400") and "image_url" in got[8]
    assert got[9].startswith("400") and "seed=3" in got[9] and "sampling.seed" in got[9], "a seed is never ignored"
    assert session.calls == 0 and session.failure is None, "refused calls are not the episode's failure"


def test_anthropic_sdk_is_refused_clearly():
    import anthropic

    def probe(_: str, url: str, key: str) -> list[str]:
        ok = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
        wrong = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
        return [status_of(lambda: wrong.messages.create(model="policy", max_tokens=8, messages=MSGS)),
                status_of(lambda: ok.messages.create(model="claude", max_tokens=8, messages=MSGS)),
                status_of(lambda: ok.messages.create(model="policy", max_tokens=8, messages=MSGS,
                                                     tool_choice={"type": "any"},
                                                     tools=[{"name": "f", "input_schema": {"type": "object"}}])),
                status_of(lambda: ok.messages.create(model="policy", max_tokens=8, messages=MSGS,
                                                     extra_body={"top_k": 5}))]

    _, got = with_session(probe)
    assert got[0].startswith("401")
    assert got[1].startswith("400") and "'claude' is not served" in got[1]
    assert got[2].startswith("400") and "tool_choice" in got[2]
    assert got[3].startswith("400") and "top_k" in got[3]


def test_reward_route_and_the_call_limit():
    import openai

    def probe(url: str, root: str, key: str) -> list[int]:
        codes = [httpx.post(f"{root}/reward", json={"reward": 0.5}, headers={"Authorization": f"Bearer {key}"}
                            ).status_code,
                 httpx.post(f"{root}/reward", json={"reward": "high"}, headers={"x-api-key": key}).status_code,
                 httpx.post(f"{root}/reward", json={"reward": 1.0}, headers={"x-api-key": "wrong"}).status_code]
        chat = openai.OpenAI(base_url=url, api_key=key, max_retries=0).chat.completions.create
        codes.append(int(status_of(lambda: chat(model="policy", messages=MSGS)).split()[0]))
        codes.append(int(status_of(lambda: chat(model="policy", messages=MSGS)).split()[0]))
        return codes

    session, codes = with_session(probe, max_calls=0)
    assert codes == [200, 400, 401, 429, 409]
    assert session.reward == 0.5
    assert session.failure is not None and "max_calls=0" in session.failure


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_binds_loopback_only(stream):
    server = AgentServer("policy", "auto", 1)
    assert server.root.startswith("http://127.0.0.1:")
