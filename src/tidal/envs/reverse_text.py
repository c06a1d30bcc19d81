"""reverse-text: reverse a random string character by character, answering inside <reversed_text> tags.

Reward: difflib's SequenceMatcher ratio between the text inside the tags and the reversed input (0 when the
opening tag is missing; an unclosed tag takes the rest of the completion). Step rewards (process
supervision): each space-separated word of the answer is a step, rewarded 1 when it equals the target's word
at the same position, else 0. Strings are random lowercase
"words" so no example can be memorized.
"""

from __future__ import annotations

import difflib
import random
import string

from tidal.envs.base import Environment, Example

OPEN, CLOSE = "<reversed_text>", "</reversed_text>"
SYSTEM_PROMPT = "Reverse the text."


def extract_answer(completion: str) -> str | None:
    """Text inside the first <reversed_text> tag (to the closing tag or the end); None without a tag."""
    start = completion.find(OPEN)
    if start < 0:
        return None
    body = completion[start + len(OPEN):]
    end = body.find(CLOSE)
    return body if end < 0 else body[:end]


def similarity(answer: str | None, target: str) -> float:
    """SequenceMatcher ratio in [0, 1]; a missing answer scores 0."""
    if answer is None:
        return 0.0
    return difflib.SequenceMatcher(None, answer, target, autojunk=False).ratio()


class ReverseText(Environment):
    """Random lowercase strings of `min_len`..`max_len` characters, words of 2..7 letters."""

    id = "reverse-text"

    def __init__(self, min_len: int = 4, max_len: int = 16) -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(f"reverse-text: need 1 <= min_len <= max_len, got {min_len}, {max_len}")
        self.min_len, self.max_len = min_len, max_len

    def random_text(self, rng: random.Random) -> str:
        length = rng.randint(self.min_len, self.max_len)
        words: list[str] = []
        while len(" ".join(words)) < length:
            words.append("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7))))
        return " ".join(words)[:length].strip() or "a"

    def sample(self, rng: random.Random) -> Example:
        text = self.random_text(rng)
        prompt = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]
        return Example(prompt=prompt, answer=text[::-1], info={"text": text})

    def reward(self, example: Example, completion: str) -> float:
        return similarity(extract_answer(completion), example.answer)

    def step_rewards(self, example: Example, completion: str) -> list[tuple[int, float]]:
        start = completion.find(OPEN)
        if start < 0:
            return [(len(completion), 0.0)]
        body = extract_answer(completion) or ""
        offset = start + len(OPEN)
        targets = example.answer.split(" ")
        out, pos = [], 0
        for k, word in enumerate(body.split(" ")):
            pos += len(word)
            out.append((offset + pos, float(k < len(targets) and word == targets[k])))
            pos += 1
        return out

    def reference_completion(self, example: Example) -> str:
        return f"{OPEN}{example.answer}{CLOSE}"
