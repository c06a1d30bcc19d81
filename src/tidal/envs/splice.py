"""The one splice rule: the tokens a chat template puts after an assistant turn for the messages that follow it.

A multi-turn rollout is trained on the token ids the model sampled, so later messages (tool results, a user's
follow-up) are appended as tokens without re-tokenizing earlier turns. The conversation is rendered without and with
the new messages (`/tokenize` on the inference server; generation prompt included the second time) and the tokens
after the k-th end-of-turn token are taken, k being the number of end-of-turn tokens in the first rendering. Counting
end-of-turn tokens instead of comparing prefixes keeps this right for templates that render earlier turns
differently once later messages follow (e.g. strip earlier `<think>` blocks). Used by the in-process tool loop
(`tidal.orchestrator.toolloop`) and by the agent endpoint (`tidal.envs.agent`).
"""

from __future__ import annotations

import asyncio
from typing import Any


class ToolTemplateError(ValueError):
    """The chat template does not render tool turns the loop can splice in."""


def turn_text(c: Any) -> str:
    """A model turn's text without its end-of-turn token's text (sampled with special tokens kept, so tool-call
    markers that are special tokens survive); `c` is a `tidal.inference.protocol.Completion`."""
    if c.finish_reason == "stop" and c.token_texts and c.text.endswith(c.token_texts[-1]):
        return str(c.text[:len(c.text) - len(c.token_texts[-1])])
    return str(c.text)


async def tool_suffix(client: Any, model: str, history: list[dict[str, Any]], results: list[dict[str, Any]],
                      stop_id: int, tools: list[dict[str, Any]] | None) -> list[int]:
    """Token ids the chat template puts after the last assistant turn's end-of-turn token `stop_id` for the messages
    `results`, through the next generation prompt (see the module docs); `client`: an `InferenceClient`."""
    before, after = await asyncio.gather(
        client.tokenize_chat(model, history, tools, add_generation_prompt=False),
        client.tokenize_chat(model, history + results, tools, add_generation_prompt=True))
    return splice_after(before, after, stop_id)


def splice_after(before: list[int], after: list[int], stop_id: int) -> list[int]:
    """The tokens of rendering `after` past its k-th `stop_id`, k = the count of `stop_id` in `before`."""
    k = before.count(stop_id)
    if k == 0:
        raise ToolTemplateError(f"the chat template does not end an assistant turn with the token the model stopped "
                                f"at (id {stop_id}); tool results cannot be spliced in after it")
    seen = 0
    for pos, tok in enumerate(after):
        seen += tok == stop_id
        if seen == k:
            suffix = after[pos + 1:]
            if not suffix:
                raise ToolTemplateError("the chat template renders nothing for the tool messages (does it handle the "
                                        "`tool` role?)")
            return suffix
    raise ToolTemplateError("the chat template renders the conversation with the tool messages with fewer "
                            "end-of-turn tokens than without them")
