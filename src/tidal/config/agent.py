"""`args` of the `agent` environment (`env: [{id: agent, args: {...}}]`, `tidal.envs.agent`): a user's own agent
program, run unchanged once per rollout against a per-session OpenAI- and Anthropic-compatible endpoint."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from tidal.config.base import StrictModel


class TaskSection(StrictModel):
    """The environment whose examples the program gets and whose reward scores the session's last answer."""

    id: str
    """Environment id (`reverse-text`, `dataset`, `package.module:Class`, ...; not `agent`)."""
    args: dict[str, Any] = Field(default_factory=dict)
    """That environment's keyword arguments."""


class AgentArgs(StrictModel):
    """A rollout is one run of the program (a session with its own base URL and key); a group is
    `rollouts_per_example` sessions of one example. See docs/agents.md."""

    command: list[str] | str | None = None
    """The program as a command (a list of arguments, or one string split like a shell would): run once per rollout
    with `OPENAI_BASE_URL`, `OPENAI_API_KEY`, `ANTHROPIC_BASE_URL`, `ANTHROPIC_API_KEY`, `TIDAL_AGENT_MODEL`,
    `TIDAL_AGENT_REWARD_URL` and the example as JSON in `TIDAL_AGENT_EXAMPLE`. Exit code 0 ends the episode; anything
    else fails it. Set this or `function`."""
    function: str | None = None
    """The program as an import path `package.module:fn` of `fn(base_url, api_key, example)` (sync: run in a thread;
    async: awaited on the orchestrator's loop); `base_url` is the OpenAI one (`.../v1`), `example` the JSON dict the
    command gets. A number it returns is the program's reward; raising fails the episode."""
    task: TaskSection
    """Where examples come from, and (reward `task` / `auto`) the reward of the session's last assistant answer."""
    reward: Literal["auto", "task", "program"] = "auto"
    """`task`: the task environment's reward of the last assistant answer; `program`: the reward the program reported
    (a callable's return value, or `POST {session}/reward {"reward": x}`); an episode without one fails; `auto`: the
    program's when it reported one, else the task's. Orch `reward_funcs` are added as for any environment (their
    `completions`: the session's messages)."""
    model: str = "policy"
    """The model name programs send (`/v1/models` lists it); any other name is answered 400."""
    timeout_s: float = Field(300.0, gt=0)
    """Seconds a program may run; past them it is killed (its whole process group) and the episode fails."""
    max_calls: int = Field(32, ge=1)
    """Model calls per session; the call past them is answered 429 and the episode fails."""
    max_session_tokens: int | None = Field(None, ge=1)
    """Sampled tokens per session over all calls (null: only `seq_len` limits a row); a call past them fails the
    episode."""
    train_forks: bool = True
    """Train a session's forked rows: a call that does not extend the session's conversation (history rewritten or
    summarised, a side call with another system prompt) starts a new row; every row of a session is trained with
    the session's reward and group advantage. false: only the session's last row (the final answer's) is trained,
    the others are counted (`agent/rows`) and dropped."""
    tool_format: Literal["auto", "hermes", "mistral", "llama3_json"] = "auto"
    """How the model writes tool calls (`tidal.envs.tools.parse_tool_calls`), parsed into `tool_calls` / `tool_use`."""
    tool_prompt: Literal["template", "system", "program"] = "template"
    """How a call's `tools` reach the model (`tidal.envs.agent.toolprompt`). `template`: the chat template renders
    them; a call with tools whose template renders the same tokens with and without them (it ignores `tools=`, as
    SmolLM2's does) is answered 400 naming the model and these ways out. `system`: tidal writes them, Hermes style,
    into the system message (a `<tools>` block and the `<tool_call>` instruction; assistant calls as `<tool_call>`
    text, tool results as `<tool_response>` user turns) and renders without `tools=`; needs `tool_format` auto or
    hermes. `program`: the program's own prompt describes its tools; `tools` only make the endpoint parse the model's
    calls, and the template renders what it renders."""
    max_concurrency: int = Field(64, ge=1)
    """Model calls sampled at once through the endpoint (all sessions); the others wait."""
    port: int = Field(0, ge=0, le=65535)
    """The endpoint's port on 127.0.0.1 (0: a free one). It binds to loopback only: every session has its own random
    key, but the endpoint trains on whatever it is sent."""

    @model_validator(mode="after")
    def _one_program(self) -> AgentArgs:
        if (self.command is None) == (self.function is None):
            raise ValueError("agent args: set command (a program to run) or function (an import path "
                             "'package.module:fn'), exactly one")
        if self.function is not None:
            module, sep, name = self.function.partition(":")
            if not (module and sep and name):
                raise ValueError(f"agent args.function '{self.function}' is not an import path 'package.module:fn'")
        if isinstance(self.command, list) and not self.command or self.command == "":
            raise ValueError("agent args.command is empty")
        if self.tool_prompt == "system" and self.tool_format not in ("auto", "hermes"):
            raise ValueError(f"agent args.tool_prompt 'system' writes Hermes <tool_call> instructions, but "
                             f"tool_format is '{self.tool_format}': set tool_format to hermes (or auto)")
        if self.task.id == "agent":
            raise ValueError("agent args.task.id names the environment that gives examples; it cannot be 'agent'")
        return self
