"""An example environment written outside tidal (docs/orchestrator.md): count the vowels of a word.

Use it with `env: [{id: "examples.my_env:CountVowels", args: {words: [...]}}]` (this directory on PYTHONPATH).
"""

from __future__ import annotations

import random
import re

from tidal.envs import Environment, Example


class CountVowels(Environment):
    id = "count-vowels"

    def __init__(self, words: list[str] | None = None) -> None:
        self.words = words or ["banana", "orchestra", "rhythm", "queue", "tidal"]

    def sample(self, rng: random.Random) -> Example:
        word = rng.choice(self.words)
        return Example(prompt=[{"role": "user", "content": f"How many vowels are in '{word}'? Answer with a number."}],
                       answer=str(sum(ch in "aeiou" for ch in word)))

    def reward(self, example: Example, completion: str) -> float:
        numbers = re.findall(r"-?\d+", completion)
        return 1.0 if numbers and numbers[-1] == example.answer else 0.0
