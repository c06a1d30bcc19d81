"""Classic verifiers environments for the e2e runs: reverse-text built with vf.SingleTurnEnv from an in-memory
dataset (longer strings than tidal's built-in), with a verifiers XMLParser and weighted Rubric; and a vf.ToolEnv
with a `reverse` tool (`build_tool_env`), which runs through tidal's tool loop."""

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


def reverse(text: str) -> str:
    """Reverse a text.

    Args:
        text: the text to reverse
    """
    return text[::-1]


def build_tool_env(n: int = 64, seed: int = 0):
    """A ToolEnv on reverse-text prompts; its reward counts the rollout's tool results (for the e2e run's
    renamed-tag model, whose calls do not parse: the environment answers each with its own error message)."""
    import verifiers as vf

    rng, gen = random.Random(seed), ReverseText(4, 12)
    texts = [gen.random_text(rng) for _ in range(n)]

    def tool_results(completion, **kwargs) -> float:
        return float(sum((m["role"] if isinstance(m, dict) else m.role) == "tool" for m in completion))

    return vf.ToolEnv(dataset=Dataset.from_list([{"question": t, "answer": t[::-1]} for t in texts]),
                      system_prompt=SYSTEM_PROMPT, tools=[reverse], max_turns=2,
                      rubric=vf.Rubric(funcs=[tool_results], weights=[1.0]))
