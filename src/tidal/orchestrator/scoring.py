"""Score rollouts: the environment's reward plus any `reward_funcs`, as one (completions x functions) matrix.

Reward functions follow TRL's interface: called once per group with `prompts`, `completions` (conversational:
`[[{"role": "assistant", "content": text}], ...]`), `completion_ids`, `trainer_state` (`{"global_step": n}`),
the example's `answer` and `info` columns, and their configured kwargs; they return one float or None per
completion. None (not applicable, e.g. a math reward on a coding prompt) is kept as NaN and skipped when the
total is summed (`advantage.combine_rewards`). A function that raises or returns the wrong number of values
stops the run with an error naming it.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from tidal.config.orch import OrchConfig
from tidal.envs.base import Environment, Example
from tidal.inference.client import Completion
from tidal.orchestrator.advantage import load_function

log = logging.getLogger("tidal.orch")


class RewardFailure(Exception):
    """A reward call failed; `kind` is 'raised', 'timeout' or 'bad output'."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind, self.detail = kind, detail


def call_with_timeout(fn: Callable[[], Any], timeout_s: float) -> Any:
    """`fn()` in a daemon thread; RewardFailure('timeout') after `timeout_s`, ('raised') with the traceback."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller with its traceback
            box["error"] = "".join(traceback.format_exception(exc))

    t = threading.Thread(target=target, daemon=True, name="reward")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise RewardFailure("timeout", f"still running after {timeout_s:g} s (reward_timeout_s)")
    if "error" in box:
        raise RewardFailure("raised", box["error"])
    return box.get("value")


class Scorer:
    """Holds the reward functions of a run; `score` returns rewards per function for one group."""

    def __init__(self, envs: Environment | dict[str, Environment], cfg: OrchConfig) -> None:
        """`envs`: one environment, or several by name (each example is scored by its `task`'s environment, and
        each environment has its own reward column: NaN for the other environments' examples)."""
        self.envs = {envs.id: envs} if isinstance(envs, Environment) else dict(envs)
        self.skip = cfg.buffer.skip_verification
        self.default, self.timeout_s = cfg.reward_default, cfg.reward_timeout_s
        self.errors: dict[str, int] = {}
        self._logged: set[tuple[str, str]] = set()
        self.funcs: list[tuple[str, Callable[..., Any], dict[str, Any]]] = []
        for rf in cfg.reward_funcs:
            fn = load_function(rf.import_path)
            self.funcs.append((rf.name or str(getattr(fn, "__name__", rf.import_path)), fn, rf.kwargs))
        self.names = list(self.envs) + [name for name, _, _ in self.funcs]
        self.weights = [cfg.env_reward_weight] * len(self.envs) + [rf.weight for rf in cfg.reward_funcs]
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"reward function names must be unique, got {self.names} (set reward_funcs[].name)")

    def score(self, example: Example, comps: list[Completion], step: int) -> np.ndarray:
        """(G, K) rewards of one group; NaN where a function returned None, `reward_default` where it failed."""
        g = len(comps)
        out = np.zeros((g, len(self.names)))
        if self.skip:
            return out
        columns = {"answer": example.answer, "task": example.task, **example.info}
        env_name = self.env_name(example)
        out[:, :len(self.envs)] = math.nan
        env = self.envs[env_name]
        calls: list[Callable[[], Any] | None] = [
            (lambda: env.reward_group(example, [c.text for c in comps])) if name == env_name else None
            for name in self.envs]
        for _name, fn, kwargs in self.funcs:
            calls.append(functools.partial(
                fn, prompts=[example.prompt] * g,
                completions=[[{"role": "assistant", "content": c.text}] for c in comps],
                completion_ids=[c.token_ids for c in comps], trainer_state={"global_step": step},
                **{col: [v] * g for col, v in columns.items()}, **kwargs))
        for k, (name, call) in enumerate(zip(self.names, calls, strict=True)):
            if call is not None:
                out[:, k] = self._checked(name, call, g, step, allow_none=k >= len(self.envs))
        return out

    def env_name(self, example: Example) -> str:
        return example.task if example.task in self.envs else next(iter(self.envs))

    @property
    def env(self) -> Environment:
        """The first (or only) environment."""
        return next(iter(self.envs.values()))

    def _checked(self, name: str, call: Callable[[], Any], g: int, step: int, allow_none: bool) -> np.ndarray:
        try:
            values = call_with_timeout(call, self.timeout_s)
            try:
                values = list(values)
            except TypeError:
                raise RewardFailure("bad output", f"returned {type(values).__name__}, not a list") from None
            if len(values) != g:
                raise RewardFailure("bad output", f"returned {len(values)} values for {g} completions")
        except RewardFailure as exc:
            self._fail(name, exc.kind, exc.detail, g, step)
            return np.full(g, self.default)
        out = np.empty(g)
        for i, v in enumerate(values):
            if v is None and allow_none:
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
