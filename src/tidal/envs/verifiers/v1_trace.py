"""verifiers 0.4 records built from tidal's: a rollout's `Trace` (its messages as `verifiers.v1` message nodes,
the sampled ones with their model calls), and the error for a feature the adapter refuses (`Unsupported`).
Shared by the taskset adapter (`v1`) and its tool sessions (`v1_tools`)."""

from __future__ import annotations

from typing import Any

from tidal.envs.images import is_image_part
from tidal.envs.verifiers.common import message_content


class Unsupported(ValueError):
    """A verifiers 0.4 feature tidal does not adapt."""

    def __init__(self, env: str, feature: str) -> None:
        super().__init__(f"verifiers environment '{env}' (verifiers 0.4): {feature} is not supported by tidal's "
                         f"adapter (docs/orchestrator.md, 'verifiers versions')")


def to_v1_message(msg: dict[str, Any]) -> Any:
    """A tidal (OpenAI-style) chat message as a `verifiers.v1` message (flat tool calls, image parts kept)."""
    from pydantic import TypeAdapter
    from verifiers.v1.types import Message

    d = {k: v for k, v in msg.items() if v is not None}
    content = d.get("content")
    if isinstance(content, list):
        if any(isinstance(p, dict) and p.get("type") not in ("text", "image_url") and is_image_part(p)
               for p in content):
            raise ValueError("verifiers 0.4 messages take images as `image_url` parts only")
        d["content"] = content
    if d.get("role") == "assistant":
        d["content"] = content if isinstance(content, str) or content is None else message_content(content)
        calls = d.pop("tool_calls", None)
        if calls:
            d["tool_calls"] = [{"id": c["id"], "name": c["function"]["name"],
                                "arguments": c["function"]["arguments"]} for c in calls]
    if d.get("role") == "tool" and not d.get("name"):
        d.pop("name", None)
    return TypeAdapter(Message).validate_python(d)


def new_trace(task: Any, messages: list[dict[str, Any]], sampled_from: int, state: Any = None,
              finish_reason: str = "stop") -> Any:
    """The `Trace` of one rollout: `messages` as a chain of nodes, those from `sampled_from` on that are assistant
    messages marked sampled (with a model call each, the last finishing with `finish_reason`)."""
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.state import state_cls
    from verifiers.v1.trace import AgentInfo, ModelCall, Trace, TraceTask

    nodes, calls = [], []
    for i, m in enumerate(messages):
        sampled = i >= sampled_from and m.get("role") == "assistant"
        nodes.append(MessageNode(parent=i - 1 if i else None, message=to_v1_message(m), sampled=sampled))
        if sampled:
            calls.append(ModelCall(node=i, finish_reason="stop"))
    if calls:
        calls[-1].finish_reason = finish_reason if finish_reason in ("stop", "length", "tool_calls") else "stop"
    state = state_cls(type(task))() if state is None else state
    return Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                 agent=AgentInfo(config=AgentConfig()), nodes=nodes, calls=calls, is_completed=True, ok=True,
                 state=state)
