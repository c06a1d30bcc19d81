"""Score rollouts: the environment's reward plus any `reward_funcs`, as one (completions x functions) matrix.

Reward functions follow TRL's interface: called once per group with `prompts`, `completions` (conversational:
`[[{"role": "assistant", "content": text}], ...]`), `completion_ids`, `trainer_state` (`{"global_step": n}`),
the example's `answer` and `info` columns, and their configured kwargs; they return one float or None per
completion. None (not applicable, e.g. a math reward on a coding prompt) is kept as NaN and skipped when the
total is summed (`advantage.combine_rewards`). A function that raises or returns the wrong number of values
stops the run with an error naming it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from tidal.config.orch import OrchConfig
from tidal.envs.base import Environment, Example
from tidal.inference.client import Completion
from tidal.orchestrator.advantage import load_function


class Scorer:
    """Holds the reward functions of a run; `score` returns rewards per function for one group."""

    def __init__(self, env: Environment, cfg: OrchConfig) -> None:
        self.env, self.skip = env, cfg.buffer.skip_verification
        self.funcs: list[tuple[str, Callable[..., Any], dict[str, Any]]] = []
        for rf in cfg.reward_funcs:
            fn = load_function(rf.import_path)
            self.funcs.append((rf.name or str(getattr(fn, "__name__", rf.import_path)), fn, rf.kwargs))
        self.names = [env.id] + [name for name, _, _ in self.funcs]
        self.weights = [cfg.env_reward_weight] + [rf.weight for rf in cfg.reward_funcs]
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"reward function names must be unique, got {self.names} (set reward_funcs[].name)")

    def score(self, example: Example, comps: list[Completion], step: int) -> np.ndarray:
        """(G, K) rewards of one group; NaN where a function returned None."""
        out = np.zeros((len(comps), len(self.names)))
        if self.skip:
            return out
        out[:, 0] = [self.env.reward(example, c.text) for c in comps]
        columns = {"answer": example.answer, **example.info}
        for k, (name, fn, kwargs) in enumerate(self.funcs, start=1):
            g = len(comps)
            values = fn(prompts=[example.prompt] * g,
                        completions=[[{"role": "assistant", "content": c.text}] for c in comps],
                        completion_ids=[c.token_ids for c in comps], trainer_state={"global_step": step},
                        **{col: [v] * g for col, v in columns.items()}, **kwargs)
            values = list(values)
            if len(values) != g:
                raise ValueError(f"reward function '{name}' returned {len(values)} values for {g} completions")
            for i, v in enumerate(values):
                out[i, k] = math.nan if v is None else float(v)
        return out

    def step_rewards(self, example: Example, comp: Completion) -> list[tuple[int, float]]:
        """The environment's step rewards mapped from character ends to completion token indices."""
        steps = self.env.step_rewards(example, comp.text)
        ends = np.cumsum([len(t) for t in comp.token_texts]) if comp.token_texts else np.zeros(0)
        out = []
        for char_end, r in steps:
            idx = int(np.searchsorted(ends, char_end, side="left")) if len(ends) else 0
            out.append((min(idx, max(len(comp.token_ids) - 1, 0)), float(r)))
        return out
