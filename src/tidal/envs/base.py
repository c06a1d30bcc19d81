"""The Environment API: a source of prompts and a reward function over completions.

An environment produces `Example`s (chat messages plus whatever the reward needs) and scores a completion's
text. It must be deterministic given its arguments and the RNG it is handed, so runs are reproducible.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Example:
    """One training prompt: the chat messages sent to the model and the data its reward needs."""

    prompt: list[dict[str, str]]
    """Chat messages, e.g. `[{"role": "system", ...}, {"role": "user", ...}]`."""
    answer: str = ""
    """Reference answer used by the reward (task-specific)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Any other per-example data."""
    task: str = ""
    """Name of the environment the example came from (set by the orchestrator; routes its scoring)."""


class Environment(ABC):
    """Base class of every environment; subclasses register themselves in `tidal.envs.registry`."""

    id: str = ""

    @abstractmethod
    def sample(self, rng: random.Random) -> Example:
        """Draw one example using `rng` (the only source of randomness)."""

    @abstractmethod
    def reward(self, example: Example, completion: str) -> float:
        """Score a completion's decoded text in [0, 1]."""

    def step_rewards(self, example: Example, completion: str) -> list[tuple[int, float]]:
        """Process supervision: (character end offset, reward) of each reasoning step of a completion, in
        order. Used by `advantage.type: process`; environments without step rewards raise."""
        raise NotImplementedError(f"environment '{self.id}' has no step rewards (advantage.type: process)")

    def eval_examples(self) -> list[Example] | None:
        """A finite held-out evaluation set, if the environment has one (None: evaluation draws generated
        examples with a fixed seed)."""
        return None

    def reference_completion(self, example: Example) -> str:
        """A perfect completion (used for SFT warm starts); environments without one raise."""
        raise NotImplementedError(f"environment '{self.id}' has no reference completions")
