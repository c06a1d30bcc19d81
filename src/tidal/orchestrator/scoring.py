"""Score rollouts: the environment's reward plus any reward functions, as one (completions x functions) matrix.

Reward functions are called as TRL's GRPOTrainer calls them, once per group (G completions of one example):
`fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., **columns, **kwargs)` where
- `prompts`: the example's prompt, once per completion (a string for a standard prompt, a message list for a
  conversational one);
- `completions`: strings for a standard prompt; `[{"role": "assistant", "content": text}]` per completion for
  a conversational one (a tool-calling rollout: all its messages, assistant turns with `tool_calls` and the
  `tool` results);
- `environments`: with an `environment_factory`, each rollout's environment instance (TRL's keyword);
- a rollout function's extra fields (`GRPOTrainer(rollout_func=...)`, `tidal.orchestrator.rollout_func`): each
  key a list with one value per completion (they replace a dataset column of the same name, as in TRL);
- `completion_ids`: the sampled token ids of each completion;
- `trainer_state`: `TrainerState` (`.global_step`, `.max_steps`; also readable as a dict);
- columns: the environment's `reward_columns` (the `dataset` environment: every dataset column but
  `prompt`; the built-ins: `answer`, `task` and the `info` columns), each a list with one value per completion;
- `log_metric(name, value)`: records a scalar; the mean of a step's values is reported as metric `name`
  (a name that is already a built-in metric is refused with a warning); TRL's `log_extra` is not passed;
- kwargs: the function's configured `kwargs` (orch `reward_funcs[].kwargs`).
It returns one float or None per completion. `async def` functions run concurrently with each other (as TRL
gathers them); the others run one after another, in order. Every call runs in a thread bounded by
`reward_timeout_s`. None (not applicable, e.g. a math reward on a coding prompt) is kept as NaN and skipped when
the total is summed (`advantage.combine_rewards`). A function that raises, times out or returns the wrong number
of values scores `reward_default` for the group and is counted and logged (once per function and kind of
failure). One that raises `tidal.rewards.ServiceUnavailable` (a service it depends on is unreachable), like a
rollout whose environment failed on its own side (`Completion.env_error`), leaves the rollouts unjudged: their
row is NaN and `env_error` says why (`tidal.orchestrator.outage`).

Functions come from orch `reward_funcs` (import paths) and, for the Python API, as callables given in process
(`extra`), so closures and lambdas work: nothing is pickled.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from tidal.config.orch import OrchConfig
from tidal.envs.base import Environment, Example
from tidal.inference.protocol import Completion
from tidal.orchestrator.advantage import load_function
from tidal.rewards import ServiceUnavailable

log = logging.getLogger("tidal.orch")


class TrainerState(dict[str, Any]):
    """What TRL passes as `trainer_state`, reduced to what the orchestrator knows: `global_step` (the step being
    sampled) and `max_steps` (None: open-ended); read as attributes (`trainer_state.global_step`, TRL's
    TrainerState) or as dict keys."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"trainer_state has no '{key}' (it has {', '.join(self)})") from None


RewardFunc = tuple[str, Callable[..., Any], float]
"""(name, function, weight) of a reward function given in process."""


def settle(value: Any) -> Any:
    """The value of a reward call: an awaitable (an `async def` reward function) is run to completion."""
    if inspect.isawaitable(value):
        async def wait() -> Any:
            return await value

        return asyncio.run(wait())
    return value


class RewardFailure(Exception):
    """A reward call failed; `kind` is 'raised', 'timeout' or 'bad output'."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind, self.detail = kind, detail


class Pending:
    """A call running in a daemon thread; `result` waits for it until a deadline."""

    def __init__(self, fn: Callable[[], Any], timeout_s: float) -> None:
        self.box: dict[str, Any] = {}
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.thread = threading.Thread(target=self._target, args=(fn,), daemon=True, name="reward")
        self.thread.start()

    def _target(self, fn: Callable[[], Any]) -> None:
        try:
            self.box["value"] = settle(fn())
        except ServiceUnavailable as exc:  # not the completions' fault: they were not judged
            self.box["unavailable"] = exc
        except BaseException as exc:  # noqa: BLE001 - reported to the caller with its traceback
            self.box["error"] = "".join(traceback.format_exception(exc))

    def result(self) -> Any:
        """The call's value; RewardFailure('timeout') past the deadline, ('raised') with the traceback."""
        self.thread.join(max(0.0, self.deadline - time.monotonic()))
        if self.thread.is_alive():
            raise RewardFailure("timeout", f"still running after {self.timeout_s:g} s (reward_timeout_s)")
        if "error" in self.box:
            raise RewardFailure("raised", self.box["error"])
        if "unavailable" in self.box:
            raise self.box["unavailable"]
        return self.box.get("value")


def is_async(call: Callable[..., Any]) -> bool:
    """An `async def` function (also behind `functools.partial`)."""
    while isinstance(call, functools.partial):
        call = call.func
    return inspect.iscoroutinefunction(call) or inspect.iscoroutinefunction(type(call).__call__)


def env_reward_funcs(envs: Any) -> list[RewardFunc]:
    """The `get_reward` of each distinct `environment_factory` environment class among `envs`' tools, as reward
    functions (`Tooling.reward_function`)."""
    out: dict[str, RewardFunc] = {}
    for env in envs:
        tooling = getattr(env, "tooling", None)
        if tooling is not None and tooling.has_reward:
            name, fn, weight = tooling.reward_function()
            out.setdefault(name, (name, fn, weight))
    return list(out.values())


class Scorer:
    """Holds the reward functions of a run; `score` returns rewards per function for one group."""

    def __init__(self, envs: Environment | dict[str, Environment], cfg: OrchConfig,
                 extra: list[RewardFunc] | None = None) -> None:
        """`envs`: one environment, or several by name (each example is scored by its `task`'s environment, and
        each environment with a reward has its own reward column: NaN for the other environments' examples).
        `extra`: reward functions given in process, after orch `reward_funcs`."""
        self.envs = {envs.id: envs} if isinstance(envs, Environment) else dict(envs)
        self.scored = [name for name, env in self.envs.items() if env.has_reward]
        """Environments with a reward column (`Environment.has_reward`)."""
        self.skip = cfg.buffer.skip_verification
        self.default, self.timeout_s = cfg.reward_default, cfg.reward_timeout_s
        self.max_steps = cfg.max_steps
        self.errors: dict[str, int] = {}
        self._logged: set[tuple[str, str]] = set()
        self._metrics: dict[str, list[float]] = {}
        self._metrics_lock = threading.Lock()
        self.funcs: list[tuple[str, Callable[..., Any], dict[str, Any]]] = []
        func_weights = []
        for rf in cfg.reward_funcs:
            fn = load_function(rf.import_path)
            self.funcs.append((rf.name or str(getattr(fn, "__name__", rf.import_path)), fn, rf.kwargs))
            func_weights.append(rf.weight)
        for name, fn, weight in [*(extra or []), *env_reward_funcs(self.envs.values())]:
            self.funcs.append((name, fn, {}))
            func_weights.append(weight)
        self.names = self.scored + [name for name, _, _ in self.funcs]
        self.weights = [cfg.env_reward_weight] * len(self.scored) + func_weights
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"reward function names must be unique, got {self.names} (set reward_funcs[].name)")
        if not self.names and not self.skip and cfg.advantage.type != "none":
            raise ValueError(f"nothing scores the completions: environment(s) {', '.join(self.envs)} have no reward "
                             f"of their own (e.g. id 'dataset'); add reward functions (orch reward_funcs, or "
                             f"GRPOTrainer(reward_funcs=...)), or train reward-free (advantage.type: none with a "
                             f"teacher: docs/algorithms.md)")

    def score(self, example: Example, comps: list[Completion], step: int) -> np.ndarray:
        """(G, K) rewards of one group; NaN where a function returned None, `reward_default` where it failed; NaN
        rows for the rollouts not judged (their `env_error` set: failed on the environment's side, or a function
        raised ServiceUnavailable)."""
        g = len(comps)
        out = np.zeros((g, len(self.names)))
        if self.skip:
            return out
        env_name = self.env_name(example)
        env = self.envs[env_name]
        n_env = len(self.scored)
        out[:, :n_env] = math.nan
        calls: list[Callable[[], Any] | None] = [
            (lambda: env.score_rollouts(example, comps)) if name == env_name else None
            for name in self.scored]
        calls += self.func_calls(env, example, comps, step)
        outcomes = self.run_calls(calls)
        for k, values in enumerate(outcomes):
            if isinstance(values, ServiceUnavailable):
                for c in comps:
                    c.env_error = c.env_error or f"{self.names[k]}: {values}"
        failed = np.array([c.env_error is not None for c in comps], dtype=bool)
        for k, values in enumerate(outcomes):
            if values is not None and not isinstance(values, ServiceUnavailable):
                out[:, k] = self._checked(self.names[k], values, g, step, allow_none=k >= n_env, skip=failed)
        out[failed] = math.nan
        return out

    def run_calls(self, calls: list[Callable[[], Any] | None]) -> list[Any]:
        """Each call's value, or its RewardFailure (None for None). `async def` functions run concurrently (each
        on its own event loop in its own thread, as TRL gathers them), beside the others, which run one at a time
        in the order given (TRL's order; a function's own state needs no lock)."""
        pending = {k: Pending(c, self.timeout_s) for k, c in enumerate(calls) if c is not None and is_async(c)}
        out: list[Any] = [None] * len(calls)
        for k, call in enumerate(calls):
            if call is not None and k not in pending:
                out[k] = self._outcome(Pending(call, self.timeout_s))
        for k, p in pending.items():
            out[k] = self._outcome(p)
        return out

    @staticmethod
    def _outcome(p: Pending) -> Any:
        try:
            return p.result()
        except (RewardFailure, ServiceUnavailable) as exc:
            return exc

    def func_calls(self, env: Environment, example: Example, comps: list[Completion],
                   step: int) -> list[Callable[[], Any]]:
        """Each reward function bound to one group's arguments, as TRL passes them (see the module docs)."""
        g = len(comps)
        if isinstance(example.prompt, str):  # standard format: strings in, strings out
            completions: list[Any] = [c.text for c in comps]
        else:  # a tool-calling rollout: its messages (assistant turns with tool_calls, tool results)
            completions = [c.messages if c.messages is not None else [{"role": "assistant", "content": c.text}]
                           for c in comps]
        columns = dict(env.reward_columns(example))
        per_comp = {col: [v] * g for col, v in columns.items()}
        if any(c.environment is not None for c in comps):
            per_comp["environments"] = [c.environment for c in comps]
        for key in dict.fromkeys(k for c in comps for k in (c.fields or {})):  # a rollout function's extra fields
            per_comp[key] = [(c.fields or {}).get(key) for c in comps]
        return [functools.partial(fn, prompts=[example.prompt] * g, completions=completions,
                                  completion_ids=[c.token_ids for c in comps],
                                  trainer_state=TrainerState(global_step=step, max_steps=self.max_steps),
                                  log_metric=self.log_metric, **per_comp, **kwargs)
                for _name, fn, kwargs in self.funcs]

    def funcs_total(self, env: Environment, example: Example, comps: list[Completion], step: int) -> np.ndarray:
        """(G,) weighted total of the reward functions alone for one group of `env`'s example (evaluation of an
        environment without a reward of its own); None entries are skipped, failures score `reward_default`."""
        g = len(comps)
        per = np.full((g, len(self.funcs)), math.nan)
        outcomes = self.run_calls(list(self.func_calls(env, example, comps, step)))
        for k, ((name, _, _), values) in enumerate(zip(self.funcs, outcomes, strict=True)):
            if isinstance(values, ServiceUnavailable):  # evaluation has no baseline to protect
                values = RewardFailure("raised", str(values))
            per[:, k] = self._checked(name, values, g, step, allow_none=True)
        total: np.ndarray = np.nansum(per * np.asarray(self.weights[len(self.scored):]), axis=1)
        return total

    def env_name(self, example: Example) -> str:
        return example.task if example.task in self.envs else next(iter(self.envs))

    @property
    def env(self) -> Environment:
        """The first (or only) environment."""
        return next(iter(self.envs.values()))

    def _checked(self, name: str, values: Any, g: int, step: int, allow_none: bool,
                 skip: np.ndarray | None = None) -> np.ndarray:
        """One function's values for a group of `g` (or its RewardFailure) as floats: NaN for an allowed None,
        `reward_default` for a failure or a non-finite value (counted and logged); NaN, neither checked nor
        counted, where `skip` (rollouts not judged)."""
        skip = np.zeros(g, dtype=bool) if skip is None else skip
        try:
            if isinstance(values, RewardFailure):
                raise values
            try:
                values = list(values)
            except TypeError:
                raise RewardFailure("bad output", f"returned {type(values).__name__}, not a list") from None
            if len(values) != g:
                raise RewardFailure("bad output", f"returned {len(values)} values for {g} completions")
        except RewardFailure as exc:
            self._fail(name, exc.kind, exc.detail, int((~skip).sum()), step)
            return np.where(skip, math.nan, self.default)
        out = np.empty(g)
        for i, v in enumerate(values):
            if (v is None and allow_none) or skip[i]:
                out[i] = math.nan
                continue
            try:
                x = float(v)
            except (TypeError, ValueError):
                x = math.nan
            if not math.isfinite(x):
                self._fail(name, "bad output", f"returned {v!r} (need a finite number{' or None' * allow_none})",
                           1, step)
                x = self.default
            out[i] = x
        return out

    def _fail(self, name: str, kind: str, detail: str, count: int, step: int) -> None:
        self.errors[name] = self.errors.get(name, 0) + count
        if (name, kind) not in self._logged:  # once per function and kind of failure
            self._logged.add((name, kind))
            log.warning("reward function '%s' %s at step %d; the affected completion(s) score reward_default "
                        "%g (counted in reward/errors; logged once per function and kind):\n%s", name,
                        {"raised": "raised", "timeout": "timed out"}.get(kind, "gave bad output"), step,
                        self.default, detail.rstrip())

    def log_metric(self, name: str, value: float) -> None:
        """TRL's `log_metric` for reward functions: record a scalar for this step's metrics (thread-safe)."""
        with self._metrics_lock:
            self._metrics.setdefault(str(name), []).append(float(value))

    def take_logged_metrics(self, taken: set[str] | frozenset[str] = frozenset()) -> dict[str, float]:
        """The mean of each metric logged since the last call; names in `taken` (built-in metrics) are dropped
        with a warning (once per name)."""
        with self._metrics_lock:
            logged, self._metrics = self._metrics, {}
        out = {}
        for name, values in logged.items():
            if name in taken:
                if ("log_metric", name) not in self._logged:
                    self._logged.add(("log_metric", name))
                    log.warning("a reward function logged metric '%s', which is a built-in metric; dropped (choose "
                                "another name)", name)
                continue
            out[name] = float(np.mean(values))
        return out

    def take_error_counts(self) -> dict[str, float]:
        """`reward/errors` and `reward/{name}/errors` since the last call (per step)."""
        out: dict[str, float] = {f"reward/{n}/errors": float(self.errors.get(n, 0)) for n in self.names}
        out["reward/errors"] = float(sum(self.errors.values()))
        self.errors = {}
        return out

    def step_rewards(self, example: Example, comp: Completion) -> list[tuple[int, float]]:
        """The environment's step rewards mapped from character ends to completion token indices."""
        steps = self.envs[self.env_name(example)].step_rewards(example, comp.text)
        ends = np.cumsum([len(t) for t in comp.token_texts]) if comp.token_texts else np.zeros(0)
        out = []
        for char_end, r in steps:
            idx = int(np.searchsorted(ends, char_end, side="left")) if len(ends) else 0
            out.append((min(idx, max(len(comp.token_ids) - 1, 0)), float(r)))
        return out
