"""reverse-text-longtail: reverse-text whose lengths follow a heavy-tailed law the user sets (a long-tail workload).

Each text repeats a random unit of 1..`unit` lowercase letters (`abab...`) up to k letters, with k drawn from a
log-normal (`median`, `sigma`) or a Pareto (`min_len`, `alpha`) law and clipped to [`min_len`, `max_len`]
(`tidal.config.environments.LongTailArgs`). The answer is the text reversed inside `<reversed_text>` tags, so a
completion is k + 3 tokens for the bundled character-level model (two tag tokens and end of turn): most
completions stop early and a few run long, the shape of reasoning and agent rollouts that a gated step waits for
(docs/orchestrator.md, "When to pick which mode"). The bundled model reverses short texts but runs on to
`max_tokens` on long repetitive ones; the reward (reverse-text's difflib similarity, which drops with every missing
or extra letter) teaches it to stop after k letters, at a different length for every example.

Simplification: the text is repetitive on purpose; its content is easy, its length is the task.
"""

from __future__ import annotations

import math
import random
import string
from typing import Any

from tidal.config.environments import LongTailArgs, check_args
from tidal.envs.base import Environment, Example
from tidal.envs.reverse_text import CLOSE, OPEN, SYSTEM_PROMPT, extract_answer, similarity


def draw_length(args: LongTailArgs, rng: random.Random) -> int:
    """One text length k (letters) from `args`' law, rounded and clipped to [min_len, max_len]."""
    if args.distribution == "lognormal":
        x = rng.lognormvariate(math.log(args.median), args.sigma)
    else:  # pareto: random.paretovariate(alpha) is >= 1 with P(X > x) = x ** -alpha
        x = args.min_len * rng.paretovariate(args.alpha)
    return min(args.max_len, max(args.min_len, round(x)))


class ReverseTextLongTail(Environment):
    """Reverse a repetitive text of heavy-tailed length (module doc); `args` are `LongTailArgs`."""

    id = "reverse-text-longtail"

    def __init__(self, **args: Any) -> None:
        self.args: LongTailArgs = check_args(LongTailArgs, f"environment '{self.id}'", args)

    def text(self, rng: random.Random) -> str:
        k = draw_length(self.args, rng)
        unit = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, self.args.unit)))
        return (unit * (k // len(unit) + 1))[:k]

    def sample(self, rng: random.Random) -> Example:
        text = self.text(rng)
        prompt = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]
        return Example(prompt=prompt, answer=text[::-1], info={"text": text, "length": len(text)})

    def reward(self, example: Example, completion: str) -> float:
        return similarity(extract_answer(completion), example.answer)

    def reference_completion(self, example: Example) -> str:
        return f"{OPEN}{example.answer}{CLOSE}"
