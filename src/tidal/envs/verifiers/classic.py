"""Adapter: an environment of the `verifiers` package (its classic API, below 0.4) used as a tidal environment.

A classic verifiers environment (`vf.SingleTurnEnv(dataset=..., system_prompt=..., parser=..., rubric=...)`,
`vf.MultiTurnEnv`, `vf.ToolEnv`; verifiers 0.1.9 to 0.3.x, where it also answers as `verifiers.legacy`) carries a
formatted HF dataset (`prompt` messages, `answer`, `info`, `task`, any other column) and a `Rubric` of weighted
reward functions, individual or group-level, that receive `prompt`, `completion`, `answer`, `state`, `info`, `task`,
the rubric's `parser` and every dataset column by name. tidal draws examples from `get_dataset()` (and evaluates
on `eval_dataset` when it has one), samples with its own vLLM client, and scores each group with the rubric's own
`score_group`, so weights, group functions, parsers and metrics behave as in verifiers.

Multi-turn environments run through tidal's tool loop (`tidal.orchestrator.toolloop`), in the model's chat format:
a `ToolEnv`'s tools (`tool_defs`) are rendered by the chat template, each model turn is parsed for tool calls
(Hermes, Mistral or Llama-3 JSON, whichever the model writes) into an OpenAI-style assistant message, and the
environment's own `env_response(messages, state)` answers it (a `ToolEnv` runs its tools; any `MultiTurnEnv`
may answer with user messages) until its stop conditions (`is_completed`: `max_turns`, no tool called, its own
`@vf.stop` methods) end the rollout. Each rollout keeps its verifiers `State` (with the `trajectory` of turns),
which the rubric scores with the rollout's messages as `completion`. Simplifications: `setup_state` runs but
sandboxes, timeouts and token-usage stops of the verifiers rollout loop do not.

Use one with `env: [{id: "verifiers:NAME", args: {...}}]` (`verifiers.load_environment`, for installed
environment packages) or `id: "package.module:factory"` where `factory(**args)` returns the environment.
verifiers 0.4 replaced this API (`verifiers.v1`: tasksets, harnesses, traces); with 0.4 installed, `verifiers:NAME`
loads a taskset package through `tidal.envs.verifiers.v1` instead (`tidal.envs.verifiers.load` picks).
Image content parts (`image_url` / `image`) are kept in the prompt as they are (with the text parts), and tidal
sends them to the model (`tidal.envs.images`); a message without images becomes plain text.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from tidal.envs.base import Environment, Example
from tidal.envs.verifiers.common import message_content, run_sync


def is_verifiers_env(obj: Any) -> bool:
    """Whether `obj` is an environment object of the `verifiers` package (classic API)."""
    return any(c.__module__.startswith("verifiers.") and c.__name__ == "Environment" for c in type(obj).__mro__) \
        and hasattr(obj, "rubric") and hasattr(obj, "get_dataset")


def _plain(value: Any) -> Any:
    """Pydantic messages and nested containers as plain JSON-able data."""
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_none=True)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


class VerifiersEnv(Environment):
    """A verifiers environment object behind tidal's Environment API."""

    def __init__(self, env: Any, name: str = "") -> None:
        if not is_verifiers_env(env):
            raise ValueError(f"{type(env).__name__} is not a verifiers environment")
        self.vf_env = env
        if callable(getattr(env, "env_response", None)) and type(env).__name__ != "SingleTurnEnv":
            self.tooling = VerifiersTooling(env)  # multi-turn: the chat-format loop
        self.id = name or getattr(env, "env_id", "") or type(env).__name__
        self.rows = [self._row(r) for r in env.get_dataset()]
        if not self.rows:
            raise ValueError(f"verifiers environment {self.id} has an empty dataset")
        eval_ds = env.eval_dataset if getattr(env, "eval_dataset", None) is not None else None
        self.eval_rows = [self._row(r) for r in eval_ds] if eval_ds is not None else None

    @staticmethod
    def _row(row: Any) -> dict[str, Any]:
        row = _plain(dict(row))
        if not isinstance(row.get("prompt"), list):
            raise ValueError(f"verifiers dataset rows need a 'prompt' list of chat messages, got {row.get('prompt')!r}")
        return row

    def _example(self, row: dict[str, Any]) -> Example:
        prompt = [{"role": m["role"], "content": message_content(m.get("content"))} for m in row["prompt"]]
        return Example(prompt=prompt, answer=str(row.get("answer", "") or ""), info={"verifiers_row": row})

    def sample(self, rng: random.Random) -> Example:
        return self._example(self.rows[rng.randrange(len(self.rows))])

    def eval_examples(self) -> list[Example] | None:
        return None if self.eval_rows is None else [self._example(r) for r in self.eval_rows]

    def _states(self, example: Example, completions: list[str]) -> list[Any]:
        row = example.info.get("verifiers_row") or {"prompt": example.prompt, "answer": example.answer}
        return [new_state(row, [{"role": "assistant", "content": text}]) for text in completions]

    def reward_group(self, example: Example, completions: list[str]) -> list[float]:
        states = self._states(example, completions)
        run_sync(self.vf_env.rubric.score_group(states))
        return [float(s["reward"]) for s in states]

    def score_rollouts(self, example: Example, rollouts: list[Any]) -> list[float]:
        """Single-turn: the texts (`reward_group`). Multi-turn: each rollout's own State (kept by its session, in
        `Completion.environment`) with the rollout's messages as `completion`."""
        if not all(getattr(r, "messages", None) is not None and isinstance(r.environment, dict) for r in rollouts):
            return self.reward_group(example, [r.text for r in rollouts])
        from verifiers.utils.message_utils import normalize_messages

        states = [r.environment for r in rollouts]
        for state, r in zip(states, rollouts, strict=True):
            state["completion"] = normalize_messages(r.messages, field_name="completion")
        run_sync(self.vf_env.rubric.score_group(states))
        return [float(s["reward"]) for s in states]

    def reward(self, example: Example, completion: str) -> float:
        return self.reward_group(example, [completion])[0]


def new_state(row: dict[str, Any], completion: list[Any]) -> Any:
    """A classic verifiers `State` for a dataset row (a plain dict in older releases)."""
    from verifiers.types import State  # the classic types (verifiers.legacy.types in 0.3)

    state = State(input={**row, "example_id": row.get("example_id", 0)})
    for key in ("prompt", "answer", "info"):
        state[key] = row.get(key, {} if key == "info" else "")
    state["completion"] = completion
    state["trajectory"] = []
    # what the releases' own `init_state` sets and their rubrics write into (0.1.10 scores into state["timing"])
    state.update(reward=None, metrics=None, error=None,
                 timing={"generation_ms": 0.0, "scoring_ms": 0.0, "total_ms": 0.0, "start_time": time.time()})
    if "task" in row:
        state["task"] = row["task"]
    return state


def tool_schemas(env: Any) -> list[dict[str, Any]]:
    """A verifiers environment's tools as OpenAI function schemas (`tool_defs`, or the older `oai_tools`)."""
    out = []
    for t in getattr(env, "tool_defs", None) or []:
        t = _plain(t)
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                     "parameters": t.get("parameters", {})}})
    return out or [_plain(t) for t in getattr(env, "oai_tools", None) or []]


class VerifiersSession:
    """One multi-turn rollout of a verifiers environment: its State, `env_response` after each model turn."""

    def __init__(self, env: Any, row: dict[str, Any]) -> None:
        self.env = env
        self.observation = None
        self.state = new_state(row, [])
        setup = getattr(env, "setup_state", None)
        if setup is not None:
            self.state = run_sync(_maybe(setup(self.state))) or self.state
        self.environment = self.state
        """Scored by `VerifiersEnv.score_rollouts` (the loop hands it on as `Completion.environment`)."""

    async def after_turn(self, history: list[dict[str, Any]], calls: list[Any]) -> list[dict[str, Any]] | None:
        """Record the turn in the State's trajectory; None when a stop condition holds, else the environment's
        answer as plain messages (tool results named after their calls)."""
        from verifiers.utils.message_utils import normalize_messages

        msgs = normalize_messages(history, field_name="messages")
        self.state["trajectory"].append({"prompt": msgs[:-1], "completion": msgs[-1:], "response": None,
                                         "tokens": None, "reward": None, "advantage": None, "is_truncated": False,
                                         "trajectory_id": "", "extras": {}})
        done = getattr(self.env, "is_completed", None)
        if done is not None and await done(self.state):
            return None
        if getattr(self.env, "max_turns", -1) > 0 and len(self.state["trajectory"]) >= self.env.max_turns:
            return None
        answer = [_plain(m) for m in await self.env.env_response(msgs, self.state)]
        names = {tc["id"]: tc["function"]["name"] for tc in history[-1].get("tool_calls", [])}
        return [{**m, "name": names.get(m.get("tool_call_id"), "")} if m.get("role") == "tool" else m
                for m in answer] or None


async def _maybe(value: Any) -> Any:
    return await value if asyncio.iscoroutine(value) else value


class VerifiersTooling:
    """A multi-turn verifiers environment behind the tool loop's `Tooling` interface."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.schemas = tool_schemas(env)
        self.fmt = "auto"
        self.max_iterations = None  # the environment's own stop conditions (max_turns) end rollouts
        self.env_type = None
        self.has_reward = False

    def open(self, row: dict[str, Any]) -> VerifiersSession:
        return VerifiersSession(self.env, row.get("verifiers_row") or row)


def load_classic(vf: Any, name: str, args: dict[str, Any] | None = None) -> Environment:
    """`verifiers.load_environment(name, **args)` of the classic verifiers module `vf` (an installed environment
    package), adapted."""
    return VerifiersEnv(vf.load_environment(name, **(args or {})), name)
