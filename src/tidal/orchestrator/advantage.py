"""Group-relative advantages: each rollout's reward minus the mean reward of its group (same prompt)."""

from __future__ import annotations

import numpy as np


def group_advantages(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """(N,) rewards laid out group by group -> (N,) advantages r - mean(group); N % group_size == 0."""
    r = np.asarray(rewards, dtype=np.float64)
    if group_size < 1 or r.size % group_size:
        raise ValueError(f"{r.size} rewards do not split into groups of {group_size}")
    groups = r.reshape(-1, group_size)
    return (groups - groups.mean(axis=1, keepdims=True)).reshape(-1)
