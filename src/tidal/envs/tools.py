"""Tools for multi-turn rollouts in the model's own chat format: schemas, tool-call parsing, tool sessions.

A tool is a type-hinted Python function with a Google-style docstring (TRL's and transformers' contract); its
JSON schema comes from `transformers.utils.get_json_schema` (pure Python; kept from loading torch) and reaches the
model through the chat template (`tools=`, rendered by the vLLM server). The model calls tools in its own format,
parsed from each model turn's text (`parse_tool_calls`):
- `hermes` (Qwen2.5/Qwen3, Hermes, many others): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (the marker is optional: it is a control token
  that detokenization may drop);
- `llama3_json` (Llama 3.1+ JSON tool calling): the whole turn is `{"name": ..., "parameters": {...}}`, optionally
  after `<|python_tag|>`;
- `auto`: whichever of the three the text shows (hermes tags, then the mistral marker or a JSON list, then a
  JSON object with `name` and `arguments`/`parameters`).
`arguments` may be a JSON object or a JSON string holding one. A call that does not parse becomes an error result
the model sees, like a tool that raised.

`Tooling` is what an environment (or a run: orch `env[].tools`, `GRPOTrainer(tools=..., environment_factory=...)`)
offers: standalone functions and/or an environment factory (TRL's `environment_factory`: a callable returning an
object whose `reset(**row)` starts a rollout, returning None or a string appended to the last user message, whose
public methods are tools, and whose optional `get_reward()` scores the finished rollout). `Tooling.open(row)` gives a
`ToolSession` per rollout: its own environment instance and the tools bound to it. The token-level loop that uses
them is `tidal.orchestrator.toolloop`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from tidal.rewards import ServiceUnavailable

ToolFormat = Literal["auto", "hermes", "mistral", "llama3_json"]
FORMATS: tuple[str, ...] = ("auto", "hermes", "mistral", "llama3_json")

HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
MISTRAL_MARK = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"


_SCHEMA_LOCK = threading.Lock()


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI-style JSON schema of a tool (`{"type": "function", "function": {...}}`), from its type hints and
    Google-style docstring by `transformers.utils.get_json_schema`; errors name the function.

    The helper is pure Python except that it imports torch, when installed, to map `torch.Tensor` hints (audio
    inputs, which a tool run by the orchestrator cannot take). In a process without torch loaded (the
    orchestrator: it never loads torch) that lookup is switched off for the call, so torch stays unloaded."""
    from transformers.utils import chat_template_utils

    try:
        with _SCHEMA_LOCK:
            saved = chat_template_utils.is_torch_available
            if "torch" not in sys.modules:
                chat_template_utils.is_torch_available = lambda: False  # type: ignore[assignment]
            try:
                return dict(chat_template_utils.get_json_schema(fn))
            finally:
                chat_template_utils.is_torch_available = saved  # type: ignore[assignment]
    except Exception as exc:  # transformers raises its own TypeError subclasses with the reason
        name = getattr(fn, "__qualname__", repr(fn))
        raise ValueError(f"tool {name}: cannot build its JSON schema ({exc}); a tool needs type hints on every "
                         f"argument and a docstring with an Args: section describing each one") from None


@dataclass
class ToolCall:
    """One parsed call: the tool's name and its keyword arguments; `error` when the call did not parse."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def message(self, call_id: str) -> dict[str, Any]:
        """The OpenAI `tool_calls` entry of an assistant message (arguments as a JSON string; vLLM hands the
        template a dict)."""
        return {"id": call_id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


def _call_of(obj: Any, where: str) -> ToolCall:
    """A ToolCall from a decoded `{"name", "arguments" | "parameters"}` object (arguments as object or JSON string)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", error=f"{where}: a tool call is a JSON object with a string 'name', got {str(obj)[:200]}")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCall(obj["name"], error=f"{where}: arguments are not valid JSON ({exc})")
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error=f"{where}: arguments must be a JSON object, got {str(args)[:200]}")
    return ToolCall(obj["name"], args)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _hermes(text: str) -> tuple[str, list[ToolCall]] | None:
    blocks = HERMES.findall(text)
    if not blocks:
        return None
    calls = []
    for block in blocks:
        obj = _json(block)
        calls.append(_call_of(obj, "<tool_call>") if obj is not None else
                     ToolCall("", error=f"<tool_call> block is not valid JSON: {block[:200]}"))
    return text[:text.index("<tool_call>")].strip(), calls


def _mistral(text: str) -> tuple[str, list[ToolCall]] | None:
    content, mark, rest = text.partition(MISTRAL_MARK)
    if not mark:
        content, rest = "", text
        if not rest.strip().startswith("["):
            return None
    obj = _json(rest.strip())
    if isinstance(obj, dict):
        obj = [obj]
    if not isinstance(obj, list):
        return (content.strip(), [ToolCall("", error=f"[TOOL_CALLS] is not followed by a JSON list: {rest[:200]}")]
                ) if mark else None
    return content.strip(), [_call_of(o, "[TOOL_CALLS]") for o in obj]


def _llama3(text: str) -> tuple[str, list[ToolCall]] | None:
    tagged = text.strip().startswith(PYTHON_TAG)
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    obj = _json(body)
    if isinstance(obj, dict) and "name" in obj and ("parameters" in obj or "arguments" in obj):
        return "", [_call_of(obj, "tool call")]
    if tagged:
        return "", [ToolCall("", error=f"<|python_tag|> is not followed by a JSON tool call: {body[:200]}")]
    return None


PARSERS = {"hermes": _hermes, "mistral": _mistral, "llama3_json": _llama3}


def parse_tool_calls(text: str, fmt: str = "auto") -> tuple[str, list[ToolCall]]:
    """(the turn's text before its tool calls, the calls) of one model turn in format `fmt` (`FORMATS`)."""
    if fmt not in FORMATS:
        raise ValueError(f"tool-call format '{fmt}' is not one of {', '.join(FORMATS)}")
    for name in (PARSERS if fmt == "auto" else [fmt]):
        parsed = PARSERS[name](text)
        if parsed is not None:
            return parsed
    return text, []


def result_text(value: Any) -> str:
    """A tool's return value as the tool message's content: strings as they are, JSON-able values as JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def public_methods(obj: Any) -> list[Callable[..., Any]]:
    """An environment's tools (TRL's rule): its class's public functions other than `reset` and `get_reward`,
    bound to `obj`."""
    names = [n for n, _ in inspect.getmembers(type(obj), predicate=inspect.isfunction)
             if not n.startswith("_") and n not in ("reset", "get_reward")]
    return [getattr(obj, n) for n in names]


class ToolSession:
    """The tools of one rollout: the standalone functions plus, with a factory, a fresh environment's methods."""

    def __init__(self, functions: list[Callable[..., Any]], environment: Any = None,
                 observation: str | None = None) -> None:
        self.environment = environment
        """The rollout's environment instance (reward functions get it in `environments`), or None."""
        self.observation = observation
        """What `environment.reset(**row)` returned (appended to the last user message), or None."""
        tools = list(functions) + (public_methods(environment) if environment is not None else [])
        self.tools = {t.__name__: t for t in tools}
        self.calls = 0
        self.failures = 0
        self.env_error: str | None = None
        """Why a tool's service was unreachable (it raised `tidal.rewards.ServiceUnavailable`): the rollout ends,
        not judged; None: it was not."""

    async def run(self, call: ToolCall) -> dict[str, Any]:
        """Run one call (sync tools in a thread, async ones awaited); the `tool` message with its result, or with
        `{"error": ...}` when the call did not parse, names no known tool, or raised."""
        self.calls += 1
        if call.error is None and call.name not in self.tools:
            call = ToolCall(call.name, error=f"unknown tool '{call.name}' (tools: {', '.join(self.tools)})")
        if call.error is not None:
            self.failures += 1
            return {"role": "tool", "name": call.name, "content": result_text({"error": call.error})}
        fn = self.tools[call.name]
        try:
            if inspect.iscoroutinefunction(fn):
                value = await fn(**call.arguments)
            else:
                value = await asyncio.to_thread(fn, **call.arguments)
        except ServiceUnavailable as exc:  # the tool's service is down: not the model's doing
            self.env_error = f"tool '{call.name}': {exc}"
            value = {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - the model sees the error, as TRL does
            self.failures += 1
            value = {"error": f"{type(exc).__name__}: {exc}"}
        return {"role": "tool", "name": call.name, "content": result_text(value)}

    async def respond(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """The tool messages answering one assistant turn's calls, in order."""
        return [await self.run(c) for c in calls]

    async def after_turn(self, history: list[dict[str, Any]], calls: list[ToolCall]) -> list[dict[str, Any]] | None:
        """The messages that answer the last assistant turn (the last of `history`, whose tool calls are `calls`):
        the tool results, or None (the rollout ends) when it called no tool. The loop's interface to a session."""
        results = await self.respond(calls) if calls else None
        return None if self.env_error is not None else results


class Tooling:
    """Standalone tool functions and/or an environment factory, with the parsing format and the iteration cap.
    The factory is called once here (as TRL does) to read its environment's tools and whether it has `get_reward`."""

    def __init__(self, functions: list[Callable[..., Any]] | None = None, environment_factory: Any = None,
                 fmt: str = "auto", max_iterations: int | None = None) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"tools format '{fmt}' is not one of {', '.join(FORMATS)}")
        self.functions = list(functions or [])
        for f in self.functions:
            if not callable(f):
                raise ValueError(f"tools: {f!r} is not a function")
        if environment_factory is not None and not callable(environment_factory):
            raise ValueError(f"environment_factory {environment_factory!r} is not callable (a class or a function "
                             f"returning an environment)")
        self.factory = environment_factory
        self.fmt = fmt
        self.max_iterations = max_iterations
        probe = environment_factory() if environment_factory is not None else None
        if probe is not None and not callable(getattr(probe, "reset", None)):
            raise ValueError(f"environment_factory gave a {type(probe).__name__} without a callable reset(**row)")
        self.env_type = type(probe) if probe is not None else None
        tools = self.functions + (public_methods(probe) if probe is not None else [])
        names = [t.__name__ for t in tools]
        if not tools:
            raise ValueError("tools: no tool functions (give functions, or an environment_factory whose "
                             "environment has public methods)")
        if len(set(names)) != len(names):
            raise ValueError(f"tools: tool names must be unique, got {names}")
        self.schemas = [tool_schema(t) for t in tools]
        """The JSON schemas the chat template renders (the same for every rollout)."""

    @property
    def has_reward(self) -> bool:
        """Whether the factory's environments score rollouts themselves (`get_reward`)."""
        return self.env_type is not None and callable(getattr(self.env_type, "get_reward", None))

    def open(self, row: dict[str, Any]) -> ToolSession:
        """A rollout's session: with a factory, a new environment instance reset with the example's row."""
        if self.factory is None:
            return ToolSession(self.functions)
        env = self.factory()
        observation = env.reset(**row)
        if observation is not None and not isinstance(observation, str):
            raise ValueError(f"{type(env).__name__}.reset() returned a {type(observation).__name__}; tidal takes "
                             f"None or a string (appended to the last user message)")
        return ToolSession(self.functions, env, observation)

    def reward_function(self) -> tuple[str, Callable[..., Any], float]:
        """The environments' `get_reward` as a reward function (named after the environment class, weight 1, as
        TRL adds it): one value per rollout, from the rollout's own environment instance."""
        assert self.env_type is not None

        async def get_reward(environments: list[Any], **_: Any) -> list[float | None]:
            out = []
            for e in environments:
                value = e.get_reward() if e is not None else None
                out.append(await value if inspect.isawaitable(value) else value)
            return out

        return self.env_type.__name__, get_reward, 1.0


def load_object(path: str, what: str) -> Any:
    """`package.module:name` imported; errors name `what` (the config key)."""
    import importlib

    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{what} '{path}' must be an import path 'package.module:name'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} '{path}': cannot import it ({exc})") from None


def tooling_from_config(functions: list[str], environment_factory: str | None, fmt: str,
                        max_iterations: int | None) -> Tooling:
    """A Tooling from orch `env[].tools` (import paths)."""
    return Tooling([load_object(f, "tools.functions entry") for f in functions],
                   load_object(environment_factory, "tools.environment_factory") if environment_factory else None,
                   fmt, max_iterations)
