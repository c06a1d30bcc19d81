"""Adapter: an environment of the `verifiers` package (its classic API) used as a tidal environment.

A classic verifiers environment (`vf.SingleTurnEnv(dataset=..., system_prompt=..., parser=..., rubric=...)`,
from `verifiers` up to 0.3, where it also answers as `verifiers.legacy`) carries a formatted HF dataset
(`prompt` messages, `answer`, `info`, `task`, any other column) and a `Rubric` of weighted reward functions,
individual or group-level, that receive `prompt`, `completion`, `answer`, `state`, `info`, `task`, the
rubric's `parser` and every dataset column by name. tidal draws examples from `get_dataset()` (and evaluates
on `eval_dataset` when it has one), samples with its own vLLM client, and scores each group with the
rubric's own `score_group`, so weights, group functions, parsers and metrics behave as in verifiers.

Use one with `env: [{id: "verifiers:NAME", args: {...}}]` (`verifiers.load_environment`, for installed
environment packages) or `id: "package.module:factory"` where `factory(**args)` returns the environment.
Multi-turn verifiers environments (`MultiTurnEnv`, `ToolEnv`) talk in chat messages and OpenAI tool calls,
which tidal's token-level multi-turn loop does not speak; they are refused with a clear error. Image content
parts (`image_url` / `image`) are kept in the prompt as they are (with the text parts), and tidal sends them to
the model (`tidal.envs.images`); a message without images becomes plain text.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
from collections.abc import Coroutine
from typing import Any

from tidal.envs.base import Environment, Example
from tidal.envs.images import is_image_part


def is_verifiers_env(obj: Any) -> bool:
    """Whether `obj` is an environment object of the `verifiers` package (classic API)."""
    return any(c.__module__.startswith("verifiers.") and c.__name__ == "Environment" for c in type(obj).__mro__) \
        and hasattr(obj, "rubric") and hasattr(obj, "get_dataset")


def run_sync(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine to completion from sync code, also when called inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, coro).result()


def _plain(value: Any) -> Any:
    """Pydantic messages and nested containers as plain JSON-able data."""
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_none=True)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _content(content: Any) -> str | list[dict[str, Any]]:
    """A message's content for tidal: plain text, or (when it holds images) its text and image parts in order."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if any(is_image_part(p) for p in content):
            return [p for p in content if is_image_part(p) or (isinstance(p, dict) and p.get("type") == "text")]
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


class VerifiersEnv(Environment):
    """A verifiers environment object behind tidal's Environment API."""

    def __init__(self, env: Any, name: str = "") -> None:
        if not is_verifiers_env(env):
            raise ValueError(f"{type(env).__name__} is not a verifiers environment")
        max_turns = getattr(env, "max_turns", 1)
        if type(env).__name__ != "SingleTurnEnv" and max_turns != 1:
            raise ValueError(f"verifiers environment {type(env).__name__} is multi-turn (max_turns {max_turns}); "
                             "tidal adapts single-turn verifiers environments (vf.SingleTurnEnv); write multi-turn "
                             "ones against tidal's Environment API (respond/stop, see docs/orchestrator.md)")
        self.vf_env = env
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
        prompt = [{"role": m["role"], "content": _content(m.get("content"))} for m in row["prompt"]]
        return Example(prompt=prompt, answer=str(row.get("answer", "") or ""), info={"verifiers_row": row})

    def sample(self, rng: random.Random) -> Example:
        return self._example(self.rows[rng.randrange(len(self.rows))])

    def eval_examples(self) -> list[Example] | None:
        return None if self.eval_rows is None else [self._example(r) for r in self.eval_rows]

    def _states(self, example: Example, completions: list[str]) -> list[Any]:
        from verifiers.types import State  # the classic types (verifiers.legacy.types in 0.3)

        row = example.info.get("verifiers_row") or {"prompt": example.prompt, "answer": example.answer}
        states = []
        for text in completions:
            state = State(input={**row, "example_id": row.get("example_id", 0)})
            for key in ("prompt", "answer", "info"):  # (older verifiers: State is a plain dict)
                state[key] = row.get(key, {} if key == "info" else "")
            state["completion"] = [{"role": "assistant", "content": text}]
            state["trajectory"] = []
            if "task" in row:
                state["task"] = row["task"]
            states.append(state)
        return states

    def reward_group(self, example: Example, completions: list[str]) -> list[float]:
        states = self._states(example, completions)
        run_sync(self.vf_env.rubric.score_group(states))
        return [float(s["reward"]) for s in states]

    def reward(self, example: Example, completion: str) -> float:
        return self.reward_group(example, [completion])[0]


def load(name: str, args: dict[str, Any] | None = None) -> VerifiersEnv:
    """`verifiers.load_environment(name, **args)` (an installed verifiers environment package), adapted."""
    try:
        import verifiers as vf
    except ImportError:
        raise ValueError(f"environment 'verifiers:{name}' needs the verifiers package (pip install "
                         "'verifiers<0.4')") from None
    loader = getattr(vf, "load_environment", None)
    if loader is None:
        raise ValueError(f"environment 'verifiers:{name}': verifiers {getattr(vf, '__version__', '?')} has no "
                         "classic load_environment (tidal adapts the classic API, verifiers < 0.4)")
    return VerifiersEnv(loader(name, **(args or {})), name)
