"""A TRL-style reward function the e2e runs load by import path (`tests.e2e.rewards:short_answer`)."""

from __future__ import annotations


def short_answer(prompts, completions, completion_ids, trainer_state, text, **kwargs):
    """1 for completions under `limit` tokens; None (not applicable) when the prompt text has odd length."""
    return [None if len(t) % 2 else float(len(ids) < kwargs["limit"])
            for t, ids in zip(text, completion_ids, strict=True)]


def standard_contains(prompts, completions, completion_ids, trainer_state, answer, **kwargs):
    """Standard (string) prompts: prompts and completions arrive as strings (anything else raises, which the run
    counts in reward/errors); 1 when the completion contains the answer's first two characters."""
    if not all(isinstance(p, str) for p in prompts) or not all(isinstance(c, str) for c in completions):
        raise TypeError(f"standard prompts must give strings, got {type(prompts[0])}, {type(completions[0])}")
    return [float(a[:2] in c) for c, a in zip(completions, answer, strict=True)]
