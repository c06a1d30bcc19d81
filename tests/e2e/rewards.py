"""A TRL-style reward function the e2e runs load by import path (`tests.e2e.rewards:short_answer`)."""

from __future__ import annotations


def short_answer(prompts, completions, completion_ids, trainer_state, text, **kwargs):
    """1 for completions under `limit` tokens; None (not applicable) when the prompt text has odd length."""
    return [None if len(t) % 2 else float(len(ids) < kwargs["limit"])
            for t, ids in zip(text, completion_ids, strict=True)]
