"""The agent endpoint's wire formats: OpenAI chat completions and Anthropic messages, to and from one message form.

Both APIs' requests become the chat-template form tidal renders (`role`, `content` as a string, assistant
`tool_calls` with JSON-string arguments, `tool` messages with `tool_call_id`); `canonical` reduces a message to what
decides whether a conversation extends another (so the assistant message a program sends back, as the SDK
re-serialises it, equals the one the endpoint returned). Answers are ordinary API objects; streamed answers are
written token by token by `tidal.envs.agent.stream`.
Simplifications: text content only (image parts are refused with 400), one choice per call.
"""

from __future__ import annotations

import json
import time
from typing import Any


class WireError(ValueError):
    """A request the endpoint refuses (answered 400 with this message)."""


def _text(content: Any, where: str) -> str:
    """A message's content as one string (OpenAI / Anthropic text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                out.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise WireError(f"{where}: content part of type {kind!r} is not supported (text only)")
        return "".join(out)
    raise WireError(f"{where}: content must be a string or a list of text parts")


def _args_json(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def openai_messages(messages: Any) -> list[dict[str, Any]]:
    """An OpenAI request's `messages` in template form (`developer` is a system message)."""
    if not isinstance(messages, list) or not messages:
        raise WireError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise WireError(f"{where}: role must be system, developer, user, assistant or tool")
        msg: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"],
                               "content": _text(m.get("content"), where)}
        if m["role"] == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = [{"id": str(c.get("id", "")), "type": "function",
                                  "function": {"name": str(c["function"]["name"]),
                                               "arguments": _args_json(c["function"].get("arguments", "{}"))}}
                                 for c in m["tool_calls"]]
        if m["role"] == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id", ""))
        if m.get("name") and m["role"] == "tool":
            msg["name"] = str(m["name"])
        out.append(msg)
    return out


def openai_tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, list) or any(not isinstance(t, dict) or t.get("type") != "function" for t in tools):
        raise WireError("'tools' must be a list of {type: function, function: {...}} objects")
    return [{"type": "function", "function": t["function"]} for t in tools]


def anthropic_messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    """An Anthropic request's `system` and `messages` (text, tool_use and tool_result blocks) in template form."""
    if not isinstance(messages, list) or not messages:
        raise WireError("'messages' must be a non-empty list")
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise WireError(f"{where}: role must be user or assistant")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        texts, calls, results = [], [], []
        for b in blocks:
            kind = b.get("type")
            if kind == "text":
                texts.append(str(b.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": str(b.get("id", "")), "type": "function",
                              "function": {"name": str(b["name"]), "arguments": json.dumps(b.get("input", {}))}})
            elif kind == "tool_result" and role == "user":
                results.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                                "content": _text(b.get("content"), f"{where} tool_result")})
            else:
                raise WireError(f"{where}: block of type {kind!r} is not supported in a {role} message")
        out += results
        if texts or calls or not results:
            msg: dict[str, Any] = {"role": role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def anthropic_tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                              "parameters": t.get("input_schema", {})}} for t in tools]


def canonical(msg: dict[str, Any]) -> tuple[Any, ...]:
    """What decides conversation identity: role, content, tool calls (name and parsed arguments), tool_call_id."""
    calls = tuple((c["function"]["name"], json.dumps(_loads(c["function"]["arguments"]), sort_keys=True))
                  for c in msg.get("tool_calls") or [])
    return msg["role"], msg.get("content") or "", calls, msg.get("tool_call_id", "")


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (json.JSONDecodeError, TypeError):
        return arguments


def openai_answer(model: str, call_id: str, message: dict[str, Any], finish: str, usage: dict[str, int]
                  ) -> dict[str, Any]:
    """A `chat.completion` object with one choice."""
    msg: dict[str, Any] = {"role": "assistant", "content": message["content"]}
    if message.get("tool_calls"):
        msg["tool_calls"] = message["tool_calls"]
    return {"id": call_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": msg, "finish_reason": openai_finish(message, finish),
                         "logprobs": None}], "usage": usage}


def openai_finish(message: dict[str, Any], finish: str) -> str:
    return "tool_calls" if message.get("tool_calls") else "length" if finish == "length" else "stop"


def anthropic_content(message: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": message["content"]}] if message["content"] else []
    for c in message.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                       "input": _loads(c["function"]["arguments"])})
    return blocks


def anthropic_stop(message: dict[str, Any], finish: str) -> str:
    return "tool_use" if message.get("tool_calls") else "max_tokens" if finish == "length" else "end_turn"


def anthropic_answer(model: str, call_id: str, message: dict[str, Any], finish: str, usage: dict[str, int]
                     ) -> dict[str, Any]:
    """A `message` object (Anthropic Messages API)."""
    return {"id": call_id, "type": "message", "role": "assistant", "model": model,
            "content": anthropic_content(message), "stop_reason": anthropic_stop(message, finish),
            "stop_sequence": None, "usage": {"input_tokens": usage["prompt_tokens"],
                                             "output_tokens": usage["completion_tokens"]}}
