"""Staleness of sampled groups: which policy versions produced them, and which a batch may still take.

A sample records the policy version(s) that produced it: `(start, end)`, the version serving when its request
started and the newest one that had (possibly) reached the server when it returned. With `weight_broadcast.reload:
lora` a request is served by one adapter wholly (start == end); with merged reloads or nccl pushes the weights
can change between two decoding steps of one request (start < end: its tokens come from both policies, and the
logprobs vLLM reported are each token's true behaviour logprob).

Staleness of a sample in batch n (which trains policy n from policy n - 1) is `(n - 1) - start`: how many
updates the oldest policy that produced it lags behind the one being trained. A group (the samples of one
prompt, kept together so its advantages stay valid) whose staleness exceeds `max_off_policy_steps` is dropped
(`is_stale`). The functions here are pure; `stream` and `assemble` use them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def staleness(step: int, start_version: int) -> int:
    """Updates between the oldest policy that produced a sample (`start_version`) and policy `step - 1`, the
    one batch `step` trains; never negative (a sample of a newer policy than `step - 1` is fresh: 0)."""
    return max(0, (step - 1) - start_version)


def is_stale(step: int, start_version: int, max_off_policy_steps: int) -> bool:
    """True when a group started under `start_version` may not go into batch `step`."""
    return staleness(step, start_version) > max_off_policy_steps


def staleness_metrics(step: int, starts: Sequence[int], ends: Sequence[int], dropped_samples: int,
                      dropped_groups: int) -> dict[str, float]:
    """Per-step metrics of the samples of batch `step` (their start and end versions, one per sample) and of
    those dropped as stale: `staleness/{s}` the number of samples with staleness s (every s from 0 to the
    maximum), `staleness/mean`, `staleness/max`, `policy_switch_samples` (samples whose weights changed during
    their request), `dropped_stale` (samples) and `dropped_stale_groups`."""
    s = np.array([staleness(step, v) for v in starts], dtype=np.int64)
    out: dict[str, float] = {"staleness/mean": float(s.mean()) if s.size else 0.0,
                             "staleness/max": float(s.max()) if s.size else 0.0,
                             "policy_switch_samples": float(sum(int(e) != int(b) for b, e in
                                                                zip(starts, ends, strict=True))),
                             "dropped_stale": float(dropped_samples), "dropped_stale_groups": float(dropped_groups)}
    counts = np.bincount(s, minlength=1) if s.size else np.zeros(1, dtype=np.int64)
    out |= {f"staleness/{k}": float(c) for k, c in enumerate(counts)}
    return out


def launch_allowed(filling: int, served: int, max_async_level: int) -> bool:
    """The in-flight gate: a new group may start while batch `filling` is being filled only when the served
    policy is at least `filling - 1 - max_async_level` (the same bound the gated mode puts on a whole batch)."""
    return served >= max(0, filling - 1 - max_async_level)
