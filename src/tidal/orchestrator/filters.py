"""Rollout filters (`filters[]`): flag degenerate completions from the tokens and logprobs vLLM reported.

- `gibberish`: a token with id >= `token_id_threshold` sampled with logprob < -ln(V) + `logprob_offset` (V =
  vocabulary size), i.e. a rare token drawn at about uniform probability, is a sign of a broken policy.
- `repetition`: `window` consecutive tokens each with probability > `prob_threshold` (the model is looping).
Each filter counts the flagged share of the step's completions (`filters/{type}/flagged`); with `enforce`
the flagged completions get no loss (their loss mask is cleared in the batch; `filters/masked`).
"""

from __future__ import annotations

import math

import numpy as np

from tidal.config.orch import GibberishFilter, RepetitionFilter
from tidal.inference.protocol import Completion


def model_vocab_size(model_name: str | None) -> int | None:
    """`vocab_size` from the model directory's config.json (a `tidal:` name or a local path; a vision-language
    model's in its `text_config`, `tidal.models.config`), if readable."""
    if not model_name:
        return None
    from tidal.models.config import model_config, text_config

    try:
        return int(text_config(model_config(model_name))["vocab_size"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def gibberish(c: Completion, f: GibberishFilter, vocab_size: int) -> bool:
    limit = -math.log(vocab_size) + f.logprob_offset
    return any(t >= f.token_id_threshold and lp < limit for t, lp in zip(c.token_ids, c.logprobs, strict=True))


def repetition(c: Completion, f: RepetitionFilter) -> bool:
    high = np.exp(np.asarray(c.logprobs, dtype=np.float64)) > f.prob_threshold
    run = best = 0
    for h in high:
        run = run + 1 if h else 0
        best = max(best, run)
    return best >= f.window


class Filters:
    """The configured filters of a run."""

    def __init__(self, filters: list[GibberishFilter | RepetitionFilter], model_name: str | None) -> None:
        """orch `filters` and `model.name` (for a gibberish filter's vocabulary size when it sets none)."""
        self.filters = filters
        self.vocab = None
        for f in self.filters:
            if isinstance(f, GibberishFilter):
                self.vocab = f.vocab_size or model_vocab_size(model_name)
                if self.vocab is None:
                    raise ValueError("filters: gibberish needs the vocabulary size: set filters[].vocab_size, or "
                                     "model.name to a local model directory")

    def apply(self, comps: list[Completion]) -> tuple[np.ndarray, dict[str, float]]:
        """(masked per completion, metrics)."""
        masked = np.zeros(len(comps), dtype=bool)
        metrics: dict[str, float] = {}
        for f in self.filters:
            if isinstance(f, GibberishFilter):
                assert self.vocab is not None
                flags = np.array([gibberish(c, f, self.vocab) for c in comps], dtype=bool)
            else:
                flags = np.array([repetition(c, f) for c in comps], dtype=bool)
            metrics[f"filters/{f.type}/flagged"] = float(flags.mean()) if len(flags) else 0.0
            if f.enforce:
                masked |= flags
        if self.filters:
            metrics["filters/masked"] = float(masked.mean()) if len(masked) else 0.0
        return masked, metrics
