"""A classic verifiers environment for the e2e runs: reverse-text built with vf.SingleTurnEnv from an
in-memory dataset (longer strings than tidal's built-in), with a verifiers XMLParser and weighted Rubric."""

from __future__ import annotations

import random

from datasets import Dataset

from tidal.envs.reverse_text import SYSTEM_PROMPT, ReverseText, similarity


def build(n: int = 64, min_len: int = 20, max_len: int = 30, seed: int = 0):
    import verifiers as vf

    rng, gen = random.Random(seed), ReverseText(min_len, max_len)
    texts = [gen.random_text(rng) for _ in range(n)]
    parser = vf.XMLParser(["reversed_text"], answer_field="reversed_text")

    def reversed_ok(completion, answer, **kwargs) -> float:
        return similarity(parser.parse_answer(completion), answer)

    rubric = vf.Rubric(funcs=[reversed_ok], weights=[1.0], parser=parser)
    return vf.SingleTurnEnv(dataset=Dataset.from_list([{"question": t, "answer": t[::-1]} for t in texts]),
                            system_prompt=SYSTEM_PROMPT, parser=parser, rubric=rubric)
