"""The Environment API: a source of prompts and a reward function over completions.

An environment produces `Example`s (a prompt plus whatever the reward needs) and scores a completion's text. A
prompt is chat messages (conversational: rendered with the model's chat template) or a plain string (standard,
TRL's term: sent as text with no template). It must be deterministic given its arguments and the RNG it is handed,
so runs are reproducible.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Example:
    """One training prompt: the chat messages sent to the model and the data its reward needs."""

    prompt: list[dict[str, Any]] | str
    """Chat messages, e.g. `[{"role": "system", ...}, {"role": "user", ...}]` (conversational), or a plain
    string continued as is, without a chat template (standard)."""
    answer: str = ""
    """Reference answer used by the reward (task-specific)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Any other per-example data."""
    task: str = ""
    """Name of the environment the example came from (set by the orchestrator; routes its scoring)."""


class Environment(ABC):
    """Base class of every environment; subclasses register themselves in `tidal.envs.registry`.

    Multi-turn environments (tool use) set `max_turns` > 1 and implement `respond`: after each model turn
    (which ends at one of `stop`, e.g. a closing tool tag, or at EOS) the environment's response text is
    appended as tokens that get no loss, and the model continues, until `respond` returns None or the turn or
    token budget is spent."""

    id: str = ""
    max_turns: int = 1
    """Model turns per rollout (1: single-turn)."""
    stop: list[str] = []  # noqa: RUF012 - class default, not mutated
    """Strings that end a model turn (sent as vLLM `stop`, kept in the output), e.g. `</calc>`."""
    tooling: Any = None
    """The tools the model may call (`tidal.envs.tools.Tooling`), rendered by the chat template and run by the
    tool loop (`tidal.orchestrator.toolloop`); None: no tools (orch `env[].tools` can add them)."""
    rollout_func: Any = None
    """A rollout function that samples this environment's groups instead of tidal
    (`tidal.orchestrator.rollout_func.RolloutFunc`, `GRPOTrainer(rollout_func=...)`); None: tidal samples them."""
    worked_reference: bool = False
    """Whether `reference_completion` writes a worked answer in the form the policy should learn (not only the bare
    answer): orch `guide_flat_groups: auto` turns reference-answer guidance on for a run whose training environments
    all say so (`tidal.orchestrator.guide`)."""
    has_reward: bool = True
    """Whether `reward` scores completions; False (the `dataset` environment): only the run's reward
    functions do, and the environment gets no reward column."""

    def reward_columns(self, example: Example) -> dict[str, Any]:
        """The keyword arguments reward functions get besides prompts/completions (one value per example; the
        scorer repeats it per completion): by default `answer`, `task` and the `info` columns."""
        return {"answer": example.answer, "task": example.task, **example.info}

    def respond(self, example: Example, transcript: str) -> str | None:
        """The environment's reply to the rollout so far (`transcript`: every model turn and reply, as text),
        e.g. a tool's output; None ends the rollout."""
        return None

    @abstractmethod
    def sample(self, rng: random.Random) -> Example:
        """Draw one example using `rng` (the only source of randomness)."""

    @abstractmethod
    def reward(self, example: Example, completion: str) -> float:
        """Score a completion's decoded text in [0, 1]."""

    def reward_group(self, example: Example, completions: list[str]) -> list[float]:
        """Scores of one group of completions of `example` (what the orchestrator calls). The default scores each
        with `reward`; environments whose rewards compare the group's completions override it."""
        return [self.reward(example, c) for c in completions]

    def score_rollouts(self, example: Example, rollouts: list[Any]) -> list[float]:
        """Scores of one group of sampled rollouts (`tidal.inference.protocol.Completion`s: `.text`, and for the
        tool loop `.messages` and `.environment`); what the orchestrator calls. The default scores the texts with
        `reward_group`; environments that score conversations (verifiers) override it."""
        return self.reward_group(example, [r.text for r in rollouts])

    def step_rewards(self, example: Example, completion: str) -> list[tuple[int, float]]:
        """Process supervision: (character end offset, reward) of each reasoning step of a completion, in
        order. Used by `advantage.type: process`; environments without step rewards raise."""
        raise NotImplementedError(f"environment '{self.id}' has no step rewards (advantage.type: process)")

    def unavailable(self) -> str | None:
        """Why the service this environment runs on cannot be reached now (naming it and where it runs), or None
        when it answers or there is none to ask. The orchestrator asks while it waits out an environment outage
        (`tidal.orchestrator.outage`); an environment whose calls fail on its own side raises
        `tidal.rewards.ServiceUnavailable` from them."""
        return None

    def eval_examples(self) -> list[Example] | None:
        """A finite held-out evaluation set, if the environment has one (None: evaluation draws generated
        examples with a fixed seed)."""
        return None

    def reference_completion(self, example: Example) -> str:
        """A perfect completion (used for SFT warm starts); environments without one raise."""
        raise NotImplementedError(f"environment '{self.id}' has no reference completions")


PROMPT_PROBES = 4
"""Examples drawn (seeds 0..3) from an environment to tell its prompt format."""


def has_chat_prompts(env: Environment) -> bool:
    """Whether `env`'s prompts need a chat template: chat messages (conversational), or tools the template renders;
    judged on `PROMPT_PROBES` drawn examples and the first of its fixed eval set. An environment that cannot draw an
    example here counts as not (its run reports what it raises)."""
    if env.tooling is not None:
        return True
    try:
        prompts = [env.sample(random.Random(i)).prompt for i in range(PROMPT_PROBES)]
        prompts += [ex.prompt for ex in (env.eval_examples() or [])[:1]]
    except Exception:  # noqa: BLE001 - a probe only
        return False
    return any(not isinstance(p, str) for p in prompts)
