"""Agent programs on the plain `openai` / `anthropic` SDKs and a copy of the bundled model that calls a tool, for the
agent endpoint's tests (`tidal.envs.agent`).

`calling_tool_model`: the bundled model answers reverse-text prompts with `<reversed_text>TXET</reversed_text>`; its
two tag tokens are renamed so that the same token ids read `<tool_call>{"name": "reverse", "arguments": {"text": "` and
`"}}</tool_call>`: without any training it writes a Hermes tool call that parses (when the reversal holds no quote),
and its template (`tests.e2e.tool_env.TOOL_TEMPLATE` without the tool list, so prompts stay as trained) renders tool
turns. The programs run a 3-turn conversation: two tool rounds (the tool's result goes back as a `tool` message when
the model called it, else the next user message asks again) and a last answer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

OPEN = '<tool_call>{"name": "reverse", "arguments": {"text": "'
CLOSE = '"}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "reverse", "description": "Reverse a text.",
                                           "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                                                          "required": ["text"]}}}]
MODEL = "policy"
DELTAS: list[int] = []
"""Per streamed call of an in-process program: the text deltas its stream carried (token by token: several)."""


def calling_tool_model(dst: Path) -> Path:
    """The bundled model at `dst` with its tag tokens renamed (module doc)."""
    from tests.e2e.tool_env import _HEAD, TOOL_TEMPLATE, tool_model

    tool_model(dst, TOOL_TEMPLATE.replace(_HEAD.split("{%- for message")[0], ""))
    path = dst / "tokenizer.json"
    tok = json.loads(path.read_text())
    names = {"<reversed_text>": OPEN, "</reversed_text>": CLOSE}
    for t in tok["added_tokens"]:
        t["content"] = names.get(t["content"], t["content"])
    vocab = tok["model"]["vocab"]
    for old, new in names.items():
        if old in vocab:
            vocab[new] = vocab.pop(old)
    path.write_text(json.dumps(tok))
    return dst


def openai_turns(client: Any, example: dict[str, Any], rounds: int = 2, stream: bool = False,
                 tools: bool = True) -> list[Any]:
    """The 3-turn conversation on the example's prompt through an `openai.OpenAI` client; returns the messages sent
    last plus the answer. `tools`: False sends no tools (the model's text is all content)."""
    messages: list[Any] = list(example["prompt"])
    text = example["info"]["text"]
    kw: dict[str, Any] = {"tools": TOOLS} if tools else {}
    for turn in range(rounds + 1):
        if stream:
            msg = collect_stream(client.chat.completions.create(model=MODEL, messages=messages, stream=True, **kw))
        else:
            msg = client.chat.completions.create(model=MODEL, messages=messages, **kw).choices[0].message
        messages.append(msg)
        if turn == rounds:
            break
        calls = msg.get("tool_calls") if isinstance(msg, dict) else msg.tool_calls
        if calls:
            for c in calls:
                fn = c["function"] if isinstance(c, dict) else c.function
                args = json.loads(fn["arguments"] if isinstance(fn, dict) else fn.arguments)
                messages.append({"role": "tool", "tool_call_id": c["id"] if isinstance(c, dict) else c.id,
                                 "content": args.get("text", "")[::-1]})
        else:
            messages.append({"role": "user", "content": text})
    return messages


def collect_stream(stream: Any) -> dict[str, Any]:
    """An assistant message (dict) from `chat.completion.chunk`s."""
    content, calls, deltas = "", {}, 0
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        deltas += bool(d.content)
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            c["id"] += tc.id or ""
            c["function"]["name"] += tc.function.name or ""
            c["function"]["arguments"] += tc.function.arguments or ""
    DELTAS.append(deltas)
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [calls[k] for k in sorted(calls)]
    return msg


def openai_program(base_url: str, api_key: str, example: dict[str, Any]) -> None:
    """A sync callable program: the 3-turn conversation on the user's text."""
    import openai

    openai_turns(openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0), example)


def streaming_program(base_url: str, api_key: str, example: dict[str, Any]) -> None:
    """The same through streamed answers."""
    import openai

    openai_turns(openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0), example, stream=True)


def untooled_program(base_url: str, api_key: str, example: dict[str, Any]) -> None:
    """The 3-turn conversation without tools (a user follow-up between turns)."""
    import openai

    openai_turns(openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0), example, tools=False)


def untooled_streaming_program(base_url: str, api_key: str, example: dict[str, Any]) -> None:
    import openai

    openai_turns(openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0), example, stream=True, tools=False)


def forking_program(base_url: str, api_key: str, example: dict[str, Any]) -> float:
    """Two turns, then a rewritten history (the first answer summarised away): a fork. Returns a reward of 0.25."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = openai_turns(client, example, rounds=1)
    summary = [*example["prompt"][:-1], {"role": "user", "content": example["info"]["text"][::-1]}]
    client.chat.completions.create(model=MODEL, messages=summary, tools=TOOLS)
    assert messages
    return 0.25


def anthropic_program(base_url: str, api_key: str, example: dict[str, Any], stream: bool = False,
                      with_tools: bool = True) -> None:
    """The 3-turn conversation through the `anthropic` SDK (`anthropic_turns`) at the session's Anthropic base URL."""
    import anthropic

    client = anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0)
    anthropic_turns(client, example, stream, with_tools)


def anthropic_turns(client: Any, example: dict[str, Any], stream: bool = False, with_tools: bool = True) -> None:
    """The 3-turn conversation through an `anthropic.Anthropic` client (tool_use / tool_result blocks; `stream`:
    through `messages.stream`, the SDK's event accumulator; `with_tools`: False sends no tools)."""
    tools = [{"name": "reverse", "description": "Reverse a text.", "input_schema": TOOLS[0]["function"]["parameters"]}]
    text = example["info"]["text"]
    system = example["prompt"][0]["content"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": example["prompt"][-1]["content"]}]
    for turn in range(3):
        kw: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "system": system, "messages": messages,
                              **({"tools": tools} if with_tools else {})}
        if stream:
            with client.messages.stream(**kw) as events:
                DELTAS.append(sum(e.type == "content_block_delta" and e.delta.type == "text_delta" for e in events))
                msg = events.get_final_message()
        else:
            msg = client.messages.create(**kw)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]})
        if turn == 2:
            break
        uses = [b for b in msg.content if b.type == "tool_use"]
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": str(b.input.get("text", ""))[::-1]}
            for b in uses] or text})


def anthropic_streaming_program(base_url: str, api_key: str, example: dict[str, Any]) -> None:
    anthropic_program(base_url, api_key, example, stream=True)


def anthropic_untooled_program(base_url: str, api_key: str, example: dict[str, Any]) -> None:
    anthropic_program(base_url, api_key, example, with_tools=False)


def anthropic_untooled_streaming_program(base_url: str, api_key: str, example: dict[str, Any]) -> None:
    anthropic_program(base_url, api_key, example, stream=True, with_tools=False)


def crashing_program(base_url: str, api_key: str, example: dict[str, Any]) -> None:
    """One call, then a crash."""
    import openai

    openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
        model=MODEL, messages=example["prompt"])
    raise RuntimeError("the agent crashed")


def main() -> None:
    """As a command: the 3-turn conversation from the environment tidal gives a program (`OPENAI_*`); argument
    `fork`: then a side call with a rewritten history (a fork: a second training row); `anthropic`: through the
    `anthropic` SDK instead (`ANTHROPIC_*`)."""
    import sys

    example = json.loads(os.environ["TIDAL_AGENT_EXAMPLE"])
    if "anthropic" in sys.argv[1:]:
        import anthropic

        anthropic_turns(anthropic.Anthropic(max_retries=0), example)  # reads ANTHROPIC_BASE_URL / ANTHROPIC_API_KEY
        return
    import openai

    client = openai.OpenAI(max_retries=0)  # reads OPENAI_BASE_URL / OPENAI_API_KEY
    openai_turns(client, example)
    if "fork" in sys.argv[1:]:
        summary = [*example["prompt"][:-1], {"role": "user", "content": example["info"]["text"][::-1]}]
        client.chat.completions.create(model=MODEL, messages=summary, tools=TOOLS)


if __name__ == "__main__":
    main()
