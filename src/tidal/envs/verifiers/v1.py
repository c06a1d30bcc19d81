"""Adapter: a taskset of verifiers 0.4 (`verifiers.v1`: tasksets, tasks, toolsets, traces) as a tidal environment.

verifiers 0.4 splits an environment into a `Taskset` (config in, typed `Task`s out: `TaskData` with `prompt`,
`system_prompt` and any task field such as `answer`), a harness (the agent program that talks to the model,
usually in a sandbox, with every model call going through verifiers' interception server) and scoring on the
rollout's `Trace` (the task's `@vf.reward` methods, weighted, summed into `trace.reward`; `@vf.metric`s).

tidal owns generation (token in, token out, from its own vLLM client), so it does not run a harness and never lets
verifiers call a model: it plays the part of verifiers' tool-less-or-MCP chat harness (`null`) itself.

- Data: the taskset is iterated once (`verifiers:NAME` loads the installed taskset package `NAME` the way
  `vf-eval` does: `args` validate into the taskset's own config class); each task becomes an `Example` whose prompt
  is its `system_prompt` plus its `prompt` (a string becomes a user message).
- Single-turn (no toolsets): tidal samples the reply; a `Trace` is built from the prompt and the reply (one sampled
  assistant node) and `Task.score(trace)` runs the task's rewards and metrics; tidal's reward is `trace.reward`.
- Tools (`Task.toolsets` per rollout, `Taskset.toolsets` shared): the toolsets' `@vf.tool` methods run in this
  process behind an in-memory MCP server (the `mcp` package verifiers uses), named `<server>_<tool>` as verifiers
  advertises them; tidal's tool loop (`tidal.orchestrator.toolloop`) renders their schemas with the chat template,
  parses the model's calls and answers with the tools' results, until a turn calls no tool, `agent.max_turns`
  (arg `agent: {max_turns: N}`) or a task `@vf.stop(trace)` predicate ends the rollout. The rollout's messages
  become the trace that is scored; the task's `State` class (or its toolsets') is the rollout's `trace.state`,
  which the tools see as `self.state`.

Refused with an error naming the environment and the feature (never ignored): an `Env` subclass of the package
(multi-agent, user simulation), a harness of its own, infinite tasksets, tasks that need a container or a runtime
(`NEEDS_CONTAINER`, `setup` / `finalize` / `stage_verifier` overrides, rewards, metrics or stops taking `runtime`),
judges (they call a model), `@vf.intercept` hooks, stops over `Request` / `Response`, toolsets on a remote `url`
or in a non-subprocess runtime, and a task without a prompt (the user opens the conversation).
"""

from __future__ import annotations

import inspect
import random
from typing import Any

from tidal.envs.base import Environment, Example
from tidal.envs.verifiers.common import message_content, run_sync
from tidal.envs.verifiers.v1_tools import V1Tooling
from tidal.envs.verifiers.v1_trace import Unsupported, new_trace


def is_v1_taskset(obj: Any) -> bool:
    """Whether `obj` is a `verifiers.v1.Taskset` (verifiers 0.4)."""
    return any(c.__module__.startswith("verifiers.v1") and c.__name__ == "Taskset" for c in type(obj).__mro__)


def available() -> bool:
    """Whether the installed verifiers is 0.4 or later (has `verifiers.v1`)."""
    import importlib.util

    try:
        return importlib.util.find_spec("verifiers.v1") is not None
    except ImportError:
        return False


def _takes(fn: Any, name: str) -> bool:
    """Whether `fn` has a required parameter `name`."""
    param = inspect.signature(fn).parameters.get(name)
    return param is not None and param.default is inspect.Parameter.empty


def _overrides(obj: Any, method: str) -> bool:
    from verifiers.v1.task import Task

    return getattr(type(obj), method) is not getattr(Task, method)


def check_task(env: str, task: Any) -> None:
    """Raise `Unsupported` for what of a task tidal cannot run (see the module docs)."""
    if task.NEEDS_CONTAINER:
        raise Unsupported(env, f"task {type(task).__name__} needs a container (NEEDS_CONTAINER)")
    for method in ("setup", "finalize", "stage_verifier"):
        if _overrides(task, method):
            raise Unsupported(env, f"task {type(task).__name__} overrides `{method}` (it needs a runtime)")
    from verifiers.v1.utils.decorators import discover_decorated

    intercepts = [fn.__name__ for fn in discover_decorated(task, "intercept")]
    if intercepts:
        raise Unsupported(env, f"task {type(task).__name__} has @vf.intercept hooks {intercepts} (tidal has no "
                               f"interception server)")
    if task.config.judges:
        raise Unsupported(env, f"task {type(task).__name__} has judges ({len(task.config.judges)}; they call a "
                               f"model)")
    for kind in ("reward", "metric", "stop"):
        for fn in task.hooks(kind):
            if _takes(fn, "runtime"):
                raise Unsupported(env, f"@vf.{kind} {fn.__name__} needs a runtime")
    for fn in task.hooks("stop"):
        params = set(inspect.signature(fn).parameters)
        if params - {"trace", "task"}:
            raise Unsupported(env, f"@vf.stop {fn.__name__} takes {sorted(params - {'trace', 'task'})} (tidal "
                                   f"evaluates stops over the trace only, not Request / Response)")
    if task.data.prompt is None:
        raise Unsupported(env, f"task {task.data.idx} has no prompt (a conversation the user opens)")


def check_toolsets(env: str, toolsets: list[Any]) -> None:
    """Toolsets run in this process: a remote `url` or another runtime than a subprocess is refused."""
    for ts in toolsets:
        cfg = ts.config
        if getattr(cfg, "url", None):
            raise Unsupported(env, f"toolset {type(ts).__name__} on a remote url ({cfg.url})")
        runtime = getattr(cfg, "runtime", None)
        if runtime is not None and type(runtime).__name__ != "SubprocessConfig":
            raise Unsupported(env, f"toolset {type(ts).__name__} in a {type(runtime).__name__} runtime")


def prompt_messages(data: Any) -> list[dict[str, Any]]:
    """A task's prompt as tidal chat messages: its `system_prompt`, then its `prompt` (a string: one user message)."""
    out: list[dict[str, Any]] = []
    if data.system_prompt:
        out.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        return [*out, {"role": "user", "content": data.prompt}]
    for m in data.prompt:
        d = m.model_dump(exclude_none=True)
        out.append({**d, "content": message_content(d.get("content"))})
    return out


def _messages(prompt: list[dict[str, Any]] | str) -> list[dict[str, Any]]:
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


async def _score(task: Any, traces: list[Any]) -> list[float]:
    for trace in traces:
        await task.score(trace)
        missing = [k for k, r in trace.rewards.items() if r is None]
        if missing:
            raise ValueError(f"verifiers task {type(task).__name__}: rewards {missing} did not score")
    return [float(t.reward) for t in traces]


class VerifiersV1Env(Environment):
    """A verifiers 0.4 taskset behind tidal's Environment API (see the module docs)."""

    def __init__(self, taskset: Any, name: str = "", max_turns: int | None = None) -> None:
        if not is_v1_taskset(taskset):
            raise ValueError(f"{type(taskset).__name__} is not a verifiers.v1 Taskset")
        self.id = name or type(taskset).__name__
        if not taskset.bounded:
            raise Unsupported(self.id, "an infinite taskset (INFINITE; bound it with take(n) in a factory)")
        self.tasks = list(taskset)
        if not self.tasks:
            raise ValueError(f"verifiers environment '{self.id}' has no tasks")
        for task in self.tasks:
            check_task(self.id, task)
        task_type = type(self.tasks[0])
        shared = type(taskset).toolsets(taskset.config)
        per_rollout = task_type.toolsets(self.tasks[0].config)
        check_toolsets(self.id, [*shared, *per_rollout])
        if shared or per_rollout:
            self.tooling = V1Tooling(self, shared, max_turns)
        elif max_turns not in (None, 1):
            raise ValueError(f"verifiers environment '{self.id}': agent.max_turns {max_turns} needs toolsets (a "
                             f"task without tools ends at the model's first reply)")

    def _example(self, k: int) -> Example:
        data = self.tasks[k].data
        answer = getattr(data, "answer", "")
        return Example(prompt=prompt_messages(data), answer="" if answer is None else str(answer),
                       info={"verifiers_task": k})

    def task_of(self, example: Example) -> Any:
        return self.tasks[int(example.info["verifiers_task"])]

    def sample(self, rng: random.Random) -> Example:
        return self._example(rng.randrange(len(self.tasks)))

    def reward_group(self, example: Example, completions: list[str]) -> list[float]:
        task, prompt = self.task_of(example), _messages(example.prompt)
        traces = [new_trace(task, [*prompt, {"role": "assistant", "content": c}], len(prompt)) for c in completions]
        return list(run_sync(_score(task, traces)))

    def score_rollouts(self, example: Example, rollouts: list[Any]) -> list[float]:
        """Each rollout's messages (tools; with its session's state) or its text as one assistant message, with its
        finish reason on the last model call (`trace.is_truncated` is true for `length`)."""
        task, prompt = self.task_of(example), _messages(example.prompt)
        traces = []
        for r in rollouts:
            messages = getattr(r, "messages", None)
            if messages is None:
                messages = [{"role": "assistant", "content": r.text}]
            traces.append(new_trace(task, [*prompt, *messages], len(prompt), getattr(r.environment, "state", None),
                                    getattr(r, "finish_reason", None) or "stop"))
        return list(run_sync(_score(task, traces)))

    def reward(self, example: Example, completion: str) -> float:
        return self.reward_group(example, [completion])[0]


def load(name: str, args: dict[str, Any] | None = None) -> VerifiersV1Env:
    """The installed taskset package `name` (verifiers 0.4's `--env.taskset.id`), its config from `args` (besides
    `agent: {max_turns: N}`), adapted."""
    from pydantic import ValidationError
    from verifiers.v1.envs.single_agent import SingleAgentEnv
    from verifiers.v1.utils import loaders

    args = dict(args or {})
    agent = dict(args.pop("agent", None) or {})
    max_turns = agent.pop("max_turns", None)
    if agent:
        raise Unsupported(name, f"agent settings {sorted(agent)} (tidal takes agent.max_turns only; it is the "
                                f"harness and the model)")
    try:
        cls = loaders.taskset_class(name)
    except (ModuleNotFoundError, TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f"environment 'verifiers:{name}': {exc}") from None
    if loaders.environment_class(name) is not SingleAgentEnv:
        raise Unsupported(name, f"its own Env ({loaders.environment_class(name).__name__}: several agents or a "
                                f"simulated user)")
    if loaders.default_harness_id(name) != "bash":
        raise Unsupported(name, "a harness of its own (tidal samples the model itself)")
    try:
        config = loaders.taskset_config_type(name).model_validate({"id": name, **args})
    except ValidationError as exc:
        raise ValueError(f"environment 'verifiers:{name}': bad args {args}: {exc}") from None
    return VerifiersV1Env(cls(config), name, max_turns)

