"""Token-by-token streams of the agent endpoint (`tidal.envs.agent.stream`): turns fed to a writer one token at a
time are read back by the real `openai` and `anthropic` SDKs (through an httpx mock transport: no server, no network)
as exactly the message the plain answer returns, whatever the turn (plain text, Hermes / Mistral / bare JSON tool
calls, markers split across tokens, leading and trailing whitespace), and text that will stay goes out before the
turn ends."""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest

from tidal.envs.agent.server import reply_message
from tidal.envs.agent.stream import AnthropicWriter, OpenAIWriter, sure_prefix
from tidal.envs.agent.wire import anthropic_content
from tidal.inference.protocol import Completion

EOT = "<|im_end|>"
CALL = '<tool_call>{"name": "reverse", "arguments": {"text": "abc"}}</tool_call>'
TURNS = [
    "The answer is cba.",
    "Let me call it. " + CALL,
    "  leading space then " + CALL,
    "trailing space   \n" + CALL + "\n" + CALL,
    CALL,
    '{"name": "reverse", "arguments": {"text": "x y"}}',
    '[TOOL_CALLS][{"name": "reverse", "arguments": {"text": "q"}}]',
    "text with < and <tool but no call",
    "<tool_call>not json</tool_call>",
    "",
]
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def tokens_of(text: str, rng: random.Random) -> list[str]:
    """`text` split at random points (1-4 characters a token), then the end-of-turn token."""
    out, i = [], 0
    while i < len(text):
        k = rng.randint(1, 4)
        out.append(text[i:i + k])
        i += k
    return [*out, EOT]


def stream_events(writer: Any, pieces: list[str], tools: bool) -> tuple[list[str], dict[str, Any], int]:
    """Feed `pieces` one token at a time as the sampler would; (events, the answer's message, events written
    before the turn ended)."""
    events: list[str] = []
    text = ""
    for p in pieces[:-1]:  # the sampler reports the text after each token but the last (the one it ends with)
        text += p
        events += writer.text(text, USAGE["prompt_tokens"])
    early, text = len(events), text + pieces[-1]
    c = Completion(list(range(len(pieces))), [-0.1] * len(pieces), text, "stop", pieces)
    message = reply_message(c, "auto", tools)
    return events + writer.finish(message, "stop", USAGE), message, early


def client_for(kind: str, body: bytes) -> Any:
    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, content=body, headers={"content-type": "text/event-stream"}))
    if kind == "openai":
        import openai

        return openai.OpenAI(base_url="http://agent/v1", api_key="k", http_client=httpx.Client(transport=transport),
                             max_retries=0)
    import anthropic
    import httpx2  # the anthropic SDK's own httpx

    mock = httpx2.MockTransport(lambda request: httpx2.Response(
        200, content=body, headers={"content-type": "text/event-stream"}))
    return anthropic.Anthropic(base_url="http://agent", api_key="k", http_client=httpx2.Client(transport=mock),
                               max_retries=0)


@pytest.mark.parametrize("tools", [True, False])
@pytest.mark.parametrize("turn", TURNS)
def test_the_sdks_accumulate_exactly_the_plain_answer(turn, tools):
    rng = random.Random(hash(turn) % 1000)
    for _ in range(3):
        pieces = tokens_of(turn, rng)
        events, message, _ = stream_events(OpenAIWriter("policy", "c1", tools, True), pieces, tools)
        client = client_for("openai", "".join(events).encode())
        content, calls = "", {}
        for chunk in client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}],
                                                    stream=True):
            if not chunk.choices:
                assert chunk.usage is not None and chunk.usage.total_tokens == 10
                continue
            d = chunk.choices[0].delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                c["id"] += tc.id or ""
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
        assert content == message["content"]
        assert [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
            (t["id"], t["function"]["name"], t["function"]["arguments"]) for t in message.get("tool_calls", [])]
        with client.chat.completions.stream(model="policy", messages=[{"role": "user", "content": "x"}]) as s:
            final = s.get_final_completion().choices[0].message
        assert (final.content or "") == message["content"]

        events, message, _ = stream_events(AnthropicWriter("policy", "m1", tools), pieces, tools)
        client = client_for("anthropic", "".join(events).encode())
        with client.messages.stream(model="policy", max_tokens=8, messages=[{"role": "user", "content": "x"}]) as s:
            got = s.get_final_message()
        assert [b.model_dump(exclude_none=True) for b in got.content] == anthropic_content(message)
        assert got.usage.input_tokens == 7 and got.usage.output_tokens == 3


def test_text_goes_out_as_it_arrives_and_a_tool_call_is_held_back():
    pieces = ["The", " answer", " is", " cba", ".", EOT]
    events, _, early = stream_events(OpenAIWriter("policy", "c1", True, False), pieces, True)
    deltas = [json.loads(e[6:])["choices"][0]["delta"].get("content") for e in events[:early]]
    assert [d for d in deltas if d] == ["The", " answer", " is", " cba"], "each token once the next one arrived"
    pieces = ["Calling", " <", "tool_call", '>{"name"', ': "reverse", "arguments": {}}</tool_call>', EOT]
    events, message, early = stream_events(AnthropicWriter("policy", "m1", True), pieces, True)
    sent = "".join(json.loads(e.split("data: ")[1])["delta"].get("text", "") for e in events[:early]
                   if "content_block_delta" in e)
    assert sent == "Calling" and message["content"] == "Calling" and message["tool_calls"]


def test_sure_prefix_keeps_only_text_that_stays():
    assert sure_prefix("hello <tool", True) == "hello"
    assert sure_prefix("hello [TOOL_C", True) == "hello"
    assert sure_prefix("hello <tool_call>{", True) == "hello"
    assert sure_prefix(" hello", True) == "" and sure_prefix('{"name"', True) == ""
    assert sure_prefix("<|python", True) == ""
    assert sure_prefix("a < b", True) == "a < b" and sure_prefix("a < b", False) == "a < b"
    assert sure_prefix("hello <tool", False) == "hello <tool"
