"""How a call's `tools` reach the model when its chat template may not render them (`AgentArgs.tool_prompt`).

A chat template that knows tools renders the request's `tools` (and assistant `tool_calls`, `tool` results) itself.
Many small instruct models' templates do not: SmolLM2's and the bundled model's render only `role` and `content`, so
`tools=` is dropped and the model never sees them. The endpoint never drops them silently:
- `template` (default): a call with `tools` is rendered with and without them (`tools_ignored`); when both give the
  same tokens the call is answered 400 naming the model and the two ways out below.
- `system`: tidal renders the tools itself, Hermes style (`with_tools_in_system`: the tool schemas in a `<tools>`
  block appended to the system message, with the `<tool_call>` instruction; assistant calls written back as
  `<tool_call>{json}</tool_call>` text; tool results as a user turn of `<tool_response>` blocks) and renders that
  conversation without `tools=`; the model's calls are parsed as Hermes (`tool_format` auto or hermes).
- `program`: the program's own prompt describes its tools (a system prompt with an example call, say); `tools` only
  tell the endpoint to parse the model's calls, and the template renders what it renders.
`SystemToolsBackend` applies `system` to a session's renderings (first prompts and the splice rule's suffixes); the
session still compares conversations in their API form, so extending calls keep extending.
"""

from __future__ import annotations

import json
from typing import Any

from tidal.envs.agent.session import Backend

HERMES_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
               "function signatures within <tools></tools> XML tags:\n<tools>")
HERMES_TAIL = ("</tools>\n\nFor each function call, return a json object with function name and arguments within "
               "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
               "<args-json-object>}\n</tool_call>")


def tools_block(tools: list[dict[str, Any]]) -> str:
    """The Hermes tool block (Qwen2.5's wording): one JSON schema per line inside `<tools>`."""
    return "\n".join([HERMES_HEAD, *(json.dumps(t, ensure_ascii=False) for t in tools), HERMES_TAIL])


def _call_text(call: dict[str, Any]) -> str:
    fn = call["function"]
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass  # written as given
    return "<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


def with_tools_in_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """`messages` (template form) as a template that knows no tools must see them (module doc, `system`): the tool
    block at the end of the system message (a system message of its own first when there is none), each assistant
    tool call as `<tool_call>` text after its content, each run of `tool` messages as one user message of
    `<tool_response>` blocks. Without tools only the calls and results are rewritten."""
    out: list[dict[str, Any]] = []
    if tools:
        if messages and messages[0]["role"] == "system":
            head, messages = messages[0], messages[1:]
            out.append({"role": "system", "content": (head["content"] + "\n\n" if head["content"] else "")
                        + tools_block(tools)})
        else:
            out.append({"role": "system", "content": tools_block(tools)})
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            parts = [m["content"]] if m.get("content") else []
            out.append({"role": "assistant", "content": "\n".join(parts + [_call_text(c) for c in m["tool_calls"]])})
        elif m["role"] == "tool":
            block = "<tool_response>\n" + m["content"] + "\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + block, "tool_results": True}
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


async def tools_ignored(backend: Backend, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> bool:
    """Whether the chat template drops `tools`: `messages` rendered with and without them give the same tokens."""
    return await backend.render(messages, tools) == await backend.render(messages, None)


class SystemToolsBackend:
    """A session backend whose renderings put the tools in the system message (`with_tools_in_system`); sampling
    is the wrapped backend's."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner

    async def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        return await self.inner.render(with_tools_in_system(messages, tools), None)

    async def suffix(self, history: list[dict[str, Any]], new: list[dict[str, Any]], stop_id: int,
                     tools: list[dict[str, Any]] | None) -> list[int]:
        # the rewrite maps the history alone to a prefix of the rewritten whole (the history ends at an assistant
        # turn, so no run of tool results spans the boundary)
        before = with_tools_in_system(history, tools)
        after = with_tools_in_system(history + new, tools)
        return await self.inner.suffix(before, after[len(before):], stop_id, None)

    async def sample(self, *args: Any, **kwargs: Any) -> Any:
        return await self.inner.sample(*args, **kwargs)

    def on_policy(self, params: dict[str, Any]) -> bool:
        return self.inner.on_policy(params)
