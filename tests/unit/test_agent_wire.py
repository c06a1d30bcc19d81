"""The agent endpoint's wire formats (`tidal.envs.agent.wire`) and its config (`tidal.config.agent`): what the SDKs
send becomes the template form, an assistant message sent back as the SDK re-serialises it equals the one returned,
Anthropic blocks map onto tool calls and tool messages, streams carry the same answer, bad args name the key."""

from __future__ import annotations

import json

import pytest

from tidal.config.environments import EnvSection
from tidal.envs.agent.stream import anthropic_stream, openai_stream
from tidal.envs.agent.wire import WireError, anthropic_messages, canonical, openai_answer, openai_messages

CALL = {"id": "call_1", "type": "function", "function": {"name": "reverse", "arguments": '{"text": "abc"}'}}
RETURNED = {"role": "assistant", "content": "", "tool_calls": [CALL]}


def test_an_sdk_echo_of_the_returned_message_is_the_same_conversation():
    import openai.types.chat as t

    answer = openai_answer("policy", "chatcmpl-1", RETURNED, "stop", {"prompt_tokens": 1, "completion_tokens": 2,
                                                                       "total_tokens": 3})
    parsed = t.ChatCompletion.model_validate(answer)
    assert parsed.choices[0].finish_reason == "tool_calls"
    echoed = parsed.choices[0].message.model_dump()  # what a program appends: refusal/audio/... None, args a string
    assert canonical(openai_messages([echoed])[0]) == canonical(RETURNED)
    reordered = {**echoed, "tool_calls": [{**CALL, "function": {"name": "reverse", "arguments": '{ "text":"abc" }'}}]}
    assert canonical(openai_messages([reordered])[0]) == canonical(RETURNED), "arguments compare as JSON"
    edited = {**echoed, "content": "I called reverse"}
    assert canonical(openai_messages([edited])[0]) != canonical(RETURNED)


def test_openai_messages_join_text_parts_and_refuse_images():
    msgs = openai_messages([{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]},
                            {"role": "tool", "tool_call_id": "c", "content": "x"}])
    assert msgs == [{"role": "system", "content": "ab"}, {"role": "tool", "content": "x", "tool_call_id": "c"}]
    with pytest.raises(WireError, match="image_url"):
        openai_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(WireError, match="role"):
        openai_messages([{"role": "wizard", "content": "x"}])


def test_anthropic_blocks_become_tool_calls_and_tool_messages():
    msgs = anthropic_messages("sys", [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"},
                                          {"type": "tool_use", "id": "t1", "name": "reverse", "input": {"text": "a"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a"}]}])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    assert json.loads(msgs[2]["tool_calls"][0]["function"]["arguments"]) == {"text": "a"}
    assert msgs[3] == {"role": "tool", "tool_call_id": "t1", "content": "a"}


def test_streams_carry_the_answer_of_the_plain_response():
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    events = openai_stream("policy", "c", {**RETURNED, "content": "hm"}, "stop", usage, True)
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert events[-1] == "data: [DONE]\n\n"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "hm"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
    assert chunks[-1]["usage"] == usage
    kinds = [e.split("\n")[0] for e in anthropic_stream("policy", "m", RETURNED, "stop", usage)]
    assert kinds == ["event: message_start", "event: content_block_start", "event: content_block_delta",
                     "event: content_block_stop", "event: message_delta", "event: message_stop"]


@pytest.mark.parametrize(("args", "message"), [
    ({"task": {"id": "reverse-text"}}, "set command"),
    ({"command": "x", "function": "a:b", "task": {"id": "reverse-text"}}, "exactly one"),
    ({"function": "nocolon", "task": {"id": "reverse-text"}}, "import path"),
    ({"command": "x", "task": {"id": "agent"}}, "cannot be 'agent'"),
    ({"command": "x", "task": {"id": "reverse-text"}, "timeout": 3}, "timeout"),
])
def test_bad_agent_args_name_the_key(args, message):
    with pytest.raises(ValueError, match=message):
        EnvSection(id="agent", args=args)
    with pytest.raises(ValueError, match="address, spawn and tools do not apply"):
        EnvSection(id="agent", args={"command": "x", "task": {"id": "reverse-text"}}, spawn=True)
