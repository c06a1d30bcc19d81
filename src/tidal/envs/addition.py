"""addition: "What is A + B? Answer with a number." for two random integers, the real-model example's task
(`make run-real`, docs/real-model.md): SmolLM2-135M-Instruct half-solves it, so GRPO has groups with both outcomes.

Reward: 1.0 when the last integer in the completion equals A + B, else 0.0 (exact match of that number). The
model's habit of restating the sum and rambling on ("12 + 30 = 42. This is ...") scores 0 when a later number
follows, so the policy learns to answer and stop. `eval_examples`: a fixed set of `eval_size` problems (seed
`eval_seed`; 256 by default, so that one problem is 0.4 points; the first 64 are the 64-problem set of earlier
releases), the same at every evaluation, in `tidal eval` and in `examples/real_model/greedy_eval.py`; with
`eval_all: true`, every problem of the task once instead (each (A, B) in [`low`, `high`] squared, A then B in
order: the task's exact accuracy, no sampling noise; at most `EVAL_ALL_MAX` problems).
`reference_completion`: the worked answer ("A + B = C"; " C" after a plain-text prompt), which reference-answer
guidance trains on by default (`worked_reference`; orch `guide_flat_groups: auto`) and SFT takes as its target.

`prompt_format: text` is the task for a base model (no chat template, e.g. `tidal:gemma3-270m`): the prompt is the
plain string "A + B =" (TRL's "standard" format, sent with no template), which a pre-trained model continues; it
goes on past the answer ("A + B = 42\n\n42 + 30 ..."), so the reward reads the FIRST integer of the completion.
"""

from __future__ import annotations

import random
import re

from tidal.envs.base import Environment, Example

INTEGER = re.compile(r"-?\d+")
EVAL_ALL_MAX = 10_000
"""The most problems `eval_all` evaluates (A, B in [0, 99] squared): a larger task is sampled (`eval_size`)."""


def last_integer(text: str) -> str | None:
    """The last integer written in `text` (commas inside numbers dropped), None when there is none."""
    found = INTEGER.findall(text.replace(",", ""))
    return found[-1].lstrip("+") if found else None


class Addition(Environment):
    """Sums of two integers in [`low`, `high`]."""

    id = "addition"
    worked_reference = True  # reference-answer guidance's default (orch guide_flat_groups auto): bench/LEARN-68.md

    def __init__(self, low: int = 10, high: int = 99, eval_size: int | None = None, eval_seed: int | None = None,
                 prompt_format: str = "chat", eval_all: bool = False) -> None:
        if not 0 <= low <= high:
            raise ValueError(f"addition: need 0 <= low <= high, got low={low}, high={high}")
        if eval_all and (eval_size is not None or eval_seed is not None):
            raise ValueError("addition: eval_all evaluates every problem once, in order: eval_size and eval_seed "
                             "would have no effect; set eval_all or them")
        if eval_all and (high - low + 1) ** 2 > EVAL_ALL_MAX:
            raise ValueError(f"addition: eval_all on [{low}, {high}] would be {(high - low + 1) ** 2} problems, more "
                             f"than {EVAL_ALL_MAX}: sample them with eval_size instead")
        eval_size = 256 if eval_size is None else eval_size
        eval_seed = 1234 if eval_seed is None else eval_seed
        if eval_size < 1:
            raise ValueError(f"addition: eval_size must be >= 1, got {eval_size}")
        if prompt_format not in ("chat", "text"):
            raise ValueError(f"addition: prompt_format must be 'chat' (a user message) or 'text' (the plain string "
                             f"'A + B =', for a base model), got {prompt_format!r}")
        self.low, self.high, self.eval_size, self.eval_seed = low, high, eval_size, eval_seed
        self.prompt_format, self.eval_all = prompt_format, eval_all

    def problem(self, a: int, b: int) -> Example:
        if self.prompt_format == "text":
            return Example(prompt=f"{a} + {b} =", answer=str(a + b), info={"a": a, "b": b})
        return Example(prompt=[{"role": "user", "content": f"What is {a} + {b}? Answer with a number."}],
                       answer=str(a + b), info={"a": a, "b": b})

    def sample(self, rng: random.Random) -> Example:
        return self.problem(rng.randint(self.low, self.high), rng.randint(self.low, self.high))

    def reward(self, example: Example, completion: str) -> float:
        if self.prompt_format == "text":  # a continuation: the answer is the first number written
            found = INTEGER.findall(completion.replace(",", ""))
            return 1.0 if found and found[0].lstrip("+") == example.answer else 0.0
        return 1.0 if last_integer(completion) == example.answer else 0.0

    def reference_completion(self, example: Example) -> str:
        """The worked answer: "A + B = C" to the chat question (what the instruct model writes when it gets it
        right), " C" after the plain-text prompt "A + B =" (its continuation)."""
        if self.prompt_format == "text":
            return f" {example.answer}"
        return f"{example.info['a']} + {example.info['b']} = {example.answer}"

    def eval_examples(self) -> list[Example] | None:
        if self.eval_all:
            span = range(self.low, self.high + 1)
            return [self.problem(a, b) for a in span for b in span]
        rng = random.Random(self.eval_seed)
        return [self.sample(rng) for _ in range(self.eval_size)]
