"""Per-step rollout metrics with TRL's names: rewards per function, reward diversity, completion lengths."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def rollout_metrics(rewards: np.ndarray, per_func: np.ndarray, names: Sequence[str], completion_lengths: np.ndarray,
                    truncated: np.ndarray, group_size: int) -> dict[str, Any]:
    """`rewards` (N,) totals (NaN: a rollout not judged, left out), `per_func` (N, K) with NaN for None, lengths
    (N,), truncated (N,) bool."""
    r = np.asarray(rewards, dtype=np.float64)
    lens = np.asarray(completion_lengths, dtype=np.float64)
    trunc = np.asarray(truncated, dtype=bool)
    groups = r.reshape(-1, group_size)
    scored = ~np.isnan(r)
    out: dict[str, Any] = {
        "reward/mean": float(r[scored].mean()) if scored.any() else 0.0,
        "reward/std": float(r[scored].std()) if scored.any() else 0.0,
        "frac_reward_zero_std": float((np.fmax.reduce(groups, axis=1) == np.fmin.reduce(groups, axis=1)).mean())}
    for k, name in enumerate(names):
        col = per_func[:, k]
        scored = col[~np.isnan(col)]
        out[f"reward/{name}/mean"] = float(scored.mean()) if scored.size else None
        out[f"reward/{name}/std"] = float(scored.std()) if scored.size else None
    done = lens[~trunc]
    out |= {"completions/mean_length": float(lens.mean()), "completions/min_length": float(lens.min()),
            "completions/max_length": float(lens.max()), "completions/clipped_ratio": float(trunc.mean()),
            "completions/mean_terminated_length": float(done.mean()) if done.size else 0.0,
            "completions/min_terminated_length": float(done.min()) if done.size else 0.0,
            "completions/max_terminated_length": float(done.max()) if done.size else 0.0}
    return out
