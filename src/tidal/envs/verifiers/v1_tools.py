"""The toolsets of a verifiers 0.4 taskset behind tidal's tool loop (`Tooling` / session interface).

verifiers 0.4 serves a toolset's `@vf.tool` methods as an MCP server in a runtime and lets the harness program
call it. tidal runs them in its own process instead: each rollout gets fresh instances of the task's toolsets
(`Task.toolsets(config)`, then `setup()` and `setup_task(task)`), the taskset's toolsets (`Taskset.toolsets`) are
set up once and shared; all of them are registered on an in-memory `mcp` server, which gives the tool schemas
(names `<server>_<tool>`, as verifiers advertises them) and validates and runs the calls. The rollout's toolset
`State` (the task's and its toolsets' custom `State` class; one at most) is the `self.state` every tool call sees
and the scored trace's `state`.

A rollout ends when a model turn calls no tool, after `agent.max_turns` model turns, or when a task `@vf.stop`
predicate over the trace so far holds; a failing tool call answers with its error text (the model sees it).
"""

from __future__ import annotations

import inspect
from typing import Any

from tidal.envs.tools import ToolCall
from tidal.envs.verifiers.common import run_sync
from tidal.envs.verifiers.v1_trace import Unsupported, new_trace


def _server(toolsets: list[Any]) -> tuple[Any, dict[str, str]]:
    """An in-memory MCP server with every `@vf.tool` of `toolsets`, and advertised name -> registered name."""
    from mcp.server.mcpserver import MCPServer
    from verifiers.v1.utils.decorators import discover_decorated

    server, names = MCPServer("tidal"), {}
    for k, ts in enumerate(toolsets):
        for fn in discover_decorated(ts, "tool"):
            raw = getattr(fn, "tool_name", None) or fn.__name__
            full = f"{ts.server_name}_{raw}" if ts.server_name else raw
            if full in names:
                raise ValueError(f"verifiers toolsets: duplicate tool name {full!r}")
            names[full] = f"t{k}_{raw}"
            server.add_tool(fn, name=names[full], description=(fn.__doc__ or "").strip() or None)
    return server, names


def _state_class(env_id: str, owners: list[Any]) -> type[Any]:
    """The rollout's State class: the custom one of the task and its toolsets (verifiers syncs one state)."""
    from verifiers.v1.state import State, state_cls

    custom = {state_cls(type(o)) for o in owners} - {State}
    if len(custom) > 1:
        raise Unsupported(env_id, f"a task and toolsets with different State classes "
                                  f"({sorted(c.__name__ for c in custom)})")
    return custom.pop() if custom else State


def _content(result: Any) -> str:
    """An MCP tool result as the tool message's text."""
    texts = [getattr(b, "text", None) or str(b) for b in getattr(result, "content", None) or []]
    return "\n".join(texts)


def _hooked(toolset: Any) -> bool:
    """Whether a toolset overrides `setup` or `setup_task` (else they need not run)."""
    from verifiers.v1.mcp.server import ServerBase

    return any(getattr(type(toolset), m) is not getattr(ServerBase, m) for m in ("setup", "setup_task"))


class V1Session:
    """One rollout: its toolsets, MCP server and State; `after_turn` runs the turn's calls."""

    def __init__(self, tooling: V1Tooling, task: Any, prompt: list[dict[str, Any]]) -> None:
        self.tooling, self.task, self.prompt = tooling, task, prompt
        self.observation = None
        self.turns = 0
        own = type(task).toolsets(task.config)
        if any(_hooked(ts) for ts in own):
            run_sync(self._setup(own))
        toolsets = [*tooling.shared, *own]
        self.server, self.names = _server(toolsets)
        self.state = _state_class(tooling.env_id, [task, *toolsets])()
        self.environment = self
        """Handed on by the loop as `Completion.environment`; `VerifiersV1Env.score_rollouts` reads `.state`."""

    async def _setup(self, toolsets: list[Any]) -> None:
        for ts in toolsets:
            await ts.setup()
            await ts.setup_task(self.task)

    async def _stopped(self, history: list[dict[str, Any]]) -> bool:
        stops = self.task.hooks("stop")
        if not stops:
            return False
        trace = new_trace(self.task, history, len(self.prompt), self.state)
        for fn in stops:
            kwargs = {k: v for k, v in (("trace", trace), ("task", self.task.data))
                      if k in inspect.signature(fn).parameters}
            out = fn(**kwargs)
            if await out if inspect.isawaitable(out) else out:
                return True
        return False

    async def call(self, call: ToolCall) -> str:
        """Run one tool call with this rollout's State as the toolset's `self.state`."""
        from verifiers.v1.mcp.server import _call_state

        if call.error:
            return f"error: {call.error}"
        registered = self.names.get(call.name)
        if registered is None:
            return f"error: unknown tool {call.name!r} (tools: {', '.join(self.names)})"
        token = _call_state.set(self.state)
        try:
            return _content(await self.server.call_tool(registered, call.arguments))
        except Exception as exc:  # the model sees a failing call's error, as in verifiers' chat harness
            return f"error: {exc}"
        finally:
            _call_state.reset(token)

    async def after_turn(self, history: list[dict[str, Any]], calls: list[ToolCall]) -> list[dict[str, Any]] | None:
        """None when the rollout ends (no call, max_turns, a stop), else the tool messages answering `calls`."""
        self.turns += 1
        if not calls or (self.tooling.max_turns is not None and self.turns >= self.tooling.max_turns):
            return None
        if await self._stopped(history):
            return None
        return [{"role": "tool", "name": c.name, "content": await self.call(c)} for c in calls]


class V1Tooling:
    """The tools of a verifiers 0.4 environment for the tool loop (`tidal.envs.tools.Tooling`'s interface)."""

    def __init__(self, env: Any, shared: list[Any], max_turns: int | None) -> None:
        self.env_id = env.id
        self.env = env
        self.shared = shared
        if any(_hooked(ts) for ts in shared):
            run_sync(self._setup_shared())
        self.max_turns = max_turns
        self.fmt = "auto"
        self.max_iterations = None  # max_turns and the task's stops end rollouts (the session)
        self.env_type = None
        self.has_reward = False
        probe = env.tasks[0]
        toolsets = [*shared, *type(probe).toolsets(probe.config)]
        server, names = _server(toolsets)
        _state_class(env.id, [probe, *toolsets])
        tools = {t.name: t for t in run_sync(server.list_tools())}
        self.schemas = [{"type": "function", "function": {"name": full, "description": tools[raw].description or "",
                                                          "parameters": tools[raw].input_schema}}
                        for full, raw in names.items()]
        """The JSON schemas the chat template renders (the same for every rollout)."""

    async def _setup_shared(self) -> None:
        for ts in self.shared:
            await ts.setup()

    def open(self, row: dict[str, Any]) -> V1Session:
        return V1Session(self, self.env.tasks[int(row["verifiers_task"])], list(row["prompt"]))
