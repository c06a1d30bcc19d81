"""TRL 1.16's adaptive entropy coefficient (train `loss.use_adaptive_entropy`, after Skywork-OR1): the entropy
bonus's coefficient moves by `entropy_coef_delta` after every optimizer step, up (to `entropy_coef_max`) when the
step's mean entropy is at or below `entropy_target`, down (to `entropy_coef_min`) otherwise, and is applied only
while the previous step's entropy is at or below the target (0 before the first step). The step's entropy is the
token-weighted mean over its micro-batches (and ranks) of the policy term's tokens, as TRL's window.

The state lives with the policy for the run (`tidal.trainer.policy.Policy.entropy`) and is checkpointed with the
trainer state (`state` / `load`: the coefficient and the last step's entropy; the window is empty between steps), so
a resumed run continues the coefficient. Without `use_adaptive_entropy` the coefficient is `entropy_coef`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from tidal.config.loss import LossConfig

SUM, TOKENS = "_entropy_bonus/sum", "_entropy_bonus/tokens"
"""The micro-batch sums `policy_loss` reports for the controller (keys starting with `_` are not metrics)."""


@dataclass
class EntropyControl:
    """The entropy bonus's coefficient across optimizer steps (see the module doc)."""

    coef: float
    """The coefficient the next optimizer step applies (if its entropy gate is open)."""
    last_entropy: float = math.inf
    """The previous optimizer step's mean entropy (inf before the first)."""
    window: list[float] = field(default_factory=lambda: [0.0, 0.0])
    """Entropy sum and tokens of the current optimizer step so far (this rank)."""

    def applied(self, cfg: LossConfig) -> float:
        """The coefficient every micro-batch of the current optimizer step uses."""
        if not cfg.use_adaptive_entropy:
            return cfg.entropy_coef
        return self.coef if self.last_entropy <= cfg.entropy_target else 0.0

    def add(self, sums: dict[str, float]) -> None:
        """Count one micro-batch's sums (`policy_loss`'s) into the step's window."""
        self.window[0] += sums.get(SUM, 0.0)
        self.window[1] += sums.get(TOKENS, 0.0)

    def step(self, cfg: LossConfig, reduce: Callable[[dict[str, float]], dict[str, float]]) -> None:
        """At the optimizer step's end: the window, reduced over the ranks (`reduce`, collective), moves the
        coefficient."""
        if not cfg.use_adaptive_entropy:
            return
        totals = reduce({"sum": self.window[0], "tokens": self.window[1]})
        self.window = [0.0, 0.0]
        entropy = totals["sum"] / max(totals["tokens"], 1.0)
        if entropy <= cfg.entropy_target:
            self.coef = min(self.coef + cfg.entropy_coef_delta, cfg.entropy_coef_max)
        else:
            self.coef = max(self.coef - cfg.entropy_coef_delta, cfg.entropy_coef_min)
        self.last_entropy = entropy

    def state(self) -> dict[str, float | None]:
        """What a checkpoint keeps (JSON: an infinite entropy, before the first step, is None)."""
        return {"coef": self.coef, "last_entropy": None if math.isinf(self.last_entropy) else self.last_entropy}

    def load(self, state: dict[str, float | None]) -> None:
        """Continue from a checkpoint's `state()`."""
        coef, last = state["coef"], state.get("last_entropy")
        if coef is None:
            raise ValueError("entropy control state without a coefficient")
        self.coef = float(coef)
        self.last_entropy = math.inf if last is None else float(last)
        self.window = [0.0, 0.0]
