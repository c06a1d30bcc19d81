"""Streamed answers of the agent endpoint, token by token: OpenAI `chat.completion.chunk` and Anthropic stream events.

A streamed call is sampled as a streamed request (`VllmClient.sample_stream`, token in), and each piece of text is
sent as it arrives: OpenAI `delta.content` chunks, Anthropic `content_block_delta` `text_delta` events. The row is the
same as without streaming (the same sampling request, the same tokens); what streams is only the text. The one rule:
what has been sent must be a prefix of the answer's final `content` (a program appends the message its SDK
accumulated; if it differed from the answer, the next call would not extend the row). So a writer sends only text
that is certain to stay:
- the newest token's text waits for the next one (the end-of-turn token's text is not part of the content);
- with tools, the text up to the first tool-call marker (`<tool_call>`, `[TOOL_CALLS]`, `<|python_tag|>`), never a
  tail that could begin one, nor trailing whitespace (the parsers strip the text before a call); a turn that starts
  with whitespace, `{` or `[` (a bare JSON call) is held back entirely.
When the turn ends, the rest of the content goes out, then the tool calls (OpenAI: `delta.tool_calls` with the id and
name, then the arguments in pieces; Anthropic: `tool_use` blocks with `input_json_delta` pieces), then the finish
reason and usage. Held-back text makes a stream coarser, never different.
"""

from __future__ import annotations

import json
import time
from typing import Any

from tidal.envs.agent.wire import _loads, anthropic_stop, openai_finish
from tidal.envs.tools import MISTRAL_MARK, PYTHON_TAG

MARKERS = ("<tool_call>", MISTRAL_MARK, PYTHON_TAG)
ARG_PIECE = 24
"""Characters of a tool call's JSON arguments per streamed piece."""


def sure_prefix(text: str, tools: bool) -> str:
    """The longest part of `text` (a turn's text so far) that will begin the answer's content (module doc)."""
    if not tools:
        return text
    head = text.lstrip()
    if head != text or head[:1] in ("{", "[") or PYTHON_TAG.startswith(head) or head.startswith(PYTHON_TAG):
        return ""
    cut = min((i for i in (text.find(m) for m in MARKERS) if i >= 0), default=len(text))
    text = text[:cut]
    for m in MARKERS:  # a tail that may grow into a marker
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                text = text[:-k]
                break
    return text.rstrip()


def _pieces(text: str) -> list[str]:
    return [text[i:i + ARG_PIECE] for i in range(0, len(text), ARG_PIECE)] or [""]


class Writer:
    """One streamed answer: `text(so_far)` as the turn grows, `finish(...)` once sampled; each returns the
    server-sent events to write. `sent`: the content sent so far."""

    def __init__(self, model: str, call_id: str, tools: bool) -> None:
        self.model, self.call_id, self.tools = model, call_id, tools
        self.sent, self.last, self.started = "", "", False

    def text(self, so_far: str, prompt_tokens: int) -> list[str]:
        """Events for the turn's text so far (the newest token's text waits: module doc)."""
        out = [] if self.started else self.start(prompt_tokens)
        self.started = True
        sure = sure_prefix(self.last, self.tools)
        self.last = so_far
        if len(sure) > len(self.sent) and sure.startswith(self.sent):
            out += self.delta(sure[len(self.sent):])
            self.sent = sure
        return out

    def finish(self, message: dict[str, Any], finish: str, usage: dict[str, int]) -> list[str]:
        """The rest of the content, the tool calls, the finish reason and usage. Raises ValueError if the text sent
        is not where the content begins (a bug: the program would fork its row)."""
        out = [] if self.started else self.start(usage["prompt_tokens"])
        self.started = True
        content = message["content"] or ""
        if not content.startswith(self.sent):
            raise ValueError(f"streamed text {self.sent!r} does not begin the answer's content {content[:200]!r}")
        if len(content) > len(self.sent):
            out += self.delta(content[len(self.sent):])
            self.sent = content
        return out + self.end(message, finish, usage)

    def start(self, prompt_tokens: int) -> list[str]:
        raise NotImplementedError

    def delta(self, text: str) -> list[str]:
        raise NotImplementedError

    def end(self, message: dict[str, Any], finish: str, usage: dict[str, int]) -> list[str]:
        raise NotImplementedError

    def error(self, status: int, message: str) -> list[str]:
        raise NotImplementedError


class OpenAIWriter(Writer):
    """`chat.completion.chunk` events ending with `data: [DONE]`; `include_usage`: a last chunk with the usage."""

    def __init__(self, model: str, call_id: str, tools: bool, include_usage: bool) -> None:
        super().__init__(model, call_id, tools)
        self.include_usage = include_usage
        self.head = {"id": call_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    def chunk(self, delta: dict[str, Any], reason: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": reason}
        return f"data: {json.dumps({**self.head, 'choices': [choice]})}\n\n"

    def start(self, prompt_tokens: int) -> list[str]:
        return [self.chunk({"role": "assistant", "content": ""})]

    def delta(self, text: str) -> list[str]:
        return [self.chunk({"content": text})]

    def end(self, message: dict[str, Any], finish: str, usage: dict[str, int]) -> list[str]:
        out = []
        for k, c in enumerate(message.get("tool_calls") or []):
            fn = c["function"]
            out.append(self.chunk({"tool_calls": [{"index": k, "id": c["id"], "type": "function",
                                                   "function": {"name": fn["name"], "arguments": ""}}]}))
            out += [self.chunk({"tool_calls": [{"index": k, "function": {"arguments": p}}]})
                    for p in _pieces(fn["arguments"])]
        out.append(self.chunk({}, openai_finish(message, finish)))
        if self.include_usage:
            out.append(f"data: {json.dumps({**self.head, 'choices': [], 'usage': usage})}\n\n")
        return [*out, "data: [DONE]\n\n"]

    def error(self, status: int, message: str) -> list[str]:
        return [f"data: {json.dumps({'error': {'message': message, 'type': 'api_error', 'code': status}})}\n\n"]


class AnthropicWriter(Writer):
    """Anthropic's events: message_start, content blocks (text, then tool_use), message_delta, message_stop."""

    def __init__(self, model: str, call_id: str, tools: bool) -> None:
        super().__init__(model, call_id, tools)
        self.blocks = 0

    @staticmethod
    def ev(kind: str, data: dict[str, Any]) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    def start(self, prompt_tokens: int) -> list[str]:
        return [self.ev("message_start", {"message": {
            "id": self.call_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})]

    def delta(self, text: str) -> list[str]:
        out = []
        if not self.blocks:
            out.append(self.ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}))
            self.blocks = 1
        return [*out, self.ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}})]

    def end(self, message: dict[str, Any], finish: str, usage: dict[str, int]) -> list[str]:
        out = [self.ev("content_block_stop", {"index": 0})] if self.blocks else []
        for c in message.get("tool_calls") or []:
            k, fn = self.blocks, c["function"]
            self.blocks += 1
            out.append(self.ev("content_block_start", {"index": k, "content_block": {
                "type": "tool_use", "id": c["id"], "name": fn["name"], "input": {}}}))
            arguments = json.dumps(_loads(fn["arguments"]))
            out += [self.ev("content_block_delta", {"index": k, "delta": {"type": "input_json_delta",
                                                                          "partial_json": p}})
                    for p in _pieces(arguments)]
            out.append(self.ev("content_block_stop", {"index": k}))
        out.append(self.ev("message_delta", {"delta": {"stop_reason": anthropic_stop(message, finish),
                                                       "stop_sequence": None},
                                             "usage": {"output_tokens": usage["completion_tokens"]}}))
        return [*out, self.ev("message_stop", {})]

    def error(self, status: int, message: str) -> list[str]:
        kind = "overloaded_error" if status == 529 else "api_error"
        return [self.ev("error", {"error": {"type": kind, "message": message}})]


def openai_stream(model: str, call_id: str, message: dict[str, Any], finish: str, usage: dict[str, int],
                  include_usage: bool) -> list[str]:
    """A whole answer as `chat.completion.chunk` events (what a stream of an already sampled turn is)."""
    return OpenAIWriter(model, call_id, bool(message.get("tool_calls")), include_usage).finish(message, finish, usage)


def anthropic_stream(model: str, call_id: str, message: dict[str, Any], finish: str, usage: dict[str, int]
                     ) -> list[str]:
    """A whole answer as Anthropic stream events."""
    return AnthropicWriter(model, call_id, bool(message.get("tool_calls"))).finish(message, finish, usage)
