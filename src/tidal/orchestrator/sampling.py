"""Per-step sampling parameters: the temperature schedule and the extra vLLM sampling keys.

`temperature_at(sampling, max_steps, step)`: `sampling.temperature`, or with `sampling.temp_scheduler` the schedule from
`start_temperature` at step 1 to `end_temperature` at step `max_steps`: linear, or cosine
(`end + (start - end) * (1 + cos(pi * p)) / 2` with p = (step - 1) / (max_steps - 1)). The batch carries the
temperature it was sampled at, so the trainer scores every batch at its own temperature.
"""

from __future__ import annotations

import math
from typing import Any

from tidal.config.orch import SamplingSection


def temperature_at(sampling: SamplingSection, max_steps: int | None, step: int) -> float:
    """The sampling temperature of batch `step` (orch `sampling`, over a run of `max_steps`)."""
    sched = sampling.temp_scheduler
    if sched is None:
        return sampling.temperature
    assert max_steps is not None  # validated with the config
    p = min(max((step - 1) / max(max_steps - 1, 1), 0.0), 1.0)
    if sched.type == "linear":
        return sched.start_temperature + (sched.end_temperature - sched.start_temperature) * p
    return sched.end_temperature + (sched.start_temperature - sched.end_temperature) * (1 + math.cos(math.pi * p)) / 2


def extra_sampling(sampling: SamplingSection, max_tokens: int) -> dict[str, Any]:
    """vLLM request keys beyond temperature and max_tokens (only those that differ from vLLM's defaults; they
    replace the client's `top_p: 1, top_k: -1`);
    `min_tokens` never exceeds the request's `max_tokens`."""
    out: dict[str, Any] = {}
    if sampling.repetition_penalty != 1.0:
        out["repetition_penalty"] = sampling.repetition_penalty
    if sampling.min_tokens:
        out["min_tokens"] = min(sampling.min_tokens, max_tokens)
    if sampling.top_p != 1.0:
        out["top_p"] = sampling.top_p
    if sampling.top_k > 0:
        out["top_k"] = sampling.top_k
    if sampling.min_p > 0:
        out["min_p"] = sampling.min_p
    return out


def max_completion_tokens(sampling: SamplingSection, seq_len: int) -> int:
    """The completion budget (dr_grpo's constant): `sampling.max_tokens`, else `seq_len`."""
    return sampling.max_tokens or seq_len
