"""`tidal.rewards.length:soft_overlong_punishment` — DAPO's soft overlong punishment as a reward function.

With L = `max_completion_len` and C = `soft_punish_cache` (tokens), a completion of n tokens scores
0 for n <= L - C, (L - C - n) / C for L - C < n <= L, and -1 beyond L (DAPO, eq. 13). Add it next to the
task reward: `reward_funcs: [{import_path: "tidal.rewards.length:soft_overlong_punishment",
kwargs: {max_completion_len: 512, soft_punish_cache: 64}}]`. Its partner, overlong filtering (no loss on
truncated completions), is the trainer's `loss.mask_truncated_completions`.
"""

from __future__ import annotations

from typing import Any


def soft_overlong_punishment(completion_ids: list[list[int]], max_completion_len: int,
                             soft_punish_cache: int, **_: Any) -> list[float]:
    if not 0 < soft_punish_cache <= max_completion_len:
        raise ValueError(f"need 0 < soft_punish_cache ({soft_punish_cache}) <= max_completion_len "
                         f"({max_completion_len})")
    start = max_completion_len - soft_punish_cache
    out = []
    for ids in completion_ids:
        n = len(ids)
        out.append(0.0 if n <= start else (start - n) / soft_punish_cache if n <= max_completion_len else -1.0)
    return out
