"""Evaluation metrics, one home for `tidal eval` and the orchestrator's online `eval`: pure functions of a
(examples, completions) reward matrix.

- `pass_at_k`: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code"):
  with n completions of a problem of which c are correct, 1 - C(n - c, k) / C(n, k), the chance that k completions
  drawn without replacement from the n hold at least one correct one; averaged over problems. At k = n it is "any of
  the n correct" (what the orchestrator's `eval/{name}/pass@{K}` has always been); at k = 1 the share of correct
  completions. A completion is correct when its reward is >= `threshold` (1.0: an exact-match reward's 1).
- `wilson`: the Wilson score interval of a proportion (greedy accuracy): honest at 0 and 1 and for small n, where the
  normal interval is not.
- `bootstrap`: a percentile bootstrap interval of a per-example statistic (mean reward, pass@k), resampling examples
  (the unit that varies between two evaluations of one model), seeded so a report is reproducible.
- `summarize`: everything `tidal eval` reports for one model on one set: mean reward, accuracy (share of examples
  whose first completion is correct: the greedy accuracy when the completions are greedy), pass@k for every k <= K,
  mean completion length and the share cut at the token limit, each with its 95% interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

Z95 = 1.959963984540054
"""The standard normal's 97.5% quantile: a two-sided 95% interval."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `n` completions, `c` of them correct (`k` <= `n`)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # 1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k / i): no huge binomials
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def per_example_pass_at_k(correct: np.ndarray, k: int) -> np.ndarray:
    """pass@k of each problem; `correct`: (N, n) booleans."""
    n = correct.shape[1]
    return np.array([pass_at_k(n, int(c), k) for c in correct.sum(axis=1)], dtype=np.float64)


def wilson(successes: int, total: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of `successes` / `total` (`total` >= 1)."""
    if total < 1 or not 0 <= successes <= total:
        raise ValueError(f"wilson needs 0 <= successes <= total and total >= 1, got {successes}/{total}")
    p, n = successes / total, total
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap(values: np.ndarray, stat: Callable[[np.ndarray], float] = np.mean, resamples: int = 2000,
              seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of `stat` over `values` (one value per example, resampled with replacement);
    a single example gives a zero-width interval."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        raise ValueError("bootstrap of no values")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, values.size, size=(resamples, values.size))
    stats = np.array([stat(values[row]) for row in picks])
    lo, hi = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def ks_up_to(n: int) -> list[int]:
    """The k of pass@k reported for n completions: every k <= n (n is small in practice: up to 16 all of them),
    else the powers of two and n."""
    if n <= 16:
        return list(range(1, n + 1))
    return sorted({2 ** i for i in range(int(math.log2(n)) + 1)} | {n})


def summarize(rewards: Sequence[Sequence[float]], lengths: Sequence[Sequence[int]],
              cut: Sequence[Sequence[bool]], threshold: float = 1.0, seed: int = 0) -> dict[str, float]:
    """The metrics of one (model, example set, sampling) with 95% intervals (`*_lo`, `*_hi`). Rows are examples,
    columns their completions (greedy: one column). Keys: `examples`, `completions`, `reward/mean`,
    `reward/std` (over all completions), `accuracy` (first completion correct), `pass@{k}` for `ks_up_to(n)`,
    `completion_len/mean`, `cut/share` (finished at the token limit)."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2 or r.size == 0:
        raise ValueError(f"rewards must be a non-empty (examples, completions) matrix, got shape {r.shape}")
    length, truncated = np.asarray(lengths, dtype=np.float64), np.asarray(cut, dtype=bool)
    if length.shape != r.shape or truncated.shape != r.shape:
        raise ValueError(f"lengths {length.shape} and cut {truncated.shape} must match rewards {r.shape}")
    correct = r >= threshold
    n_ex, n = r.shape
    out: dict[str, float] = {"examples": n_ex, "completions": n, "reward/std": float(r.std())}

    def put(key: str, per_example: np.ndarray, interval: tuple[float, float] | None = None) -> None:
        out[key] = float(per_example.mean())
        out[f"{key}_lo"], out[f"{key}_hi"] = interval or bootstrap(per_example, seed=seed)

    put("reward/mean", r.mean(axis=1))
    first = correct[:, 0]
    put("accuracy", first.astype(np.float64), wilson(int(first.sum()), n_ex))
    for k in ks_up_to(n):
        put(f"pass@{k}", per_example_pass_at_k(correct, k))
    put("completion_len/mean", length.mean(axis=1))
    share = truncated.mean(axis=1)
    put("cut/share", share, wilson(int(truncated.sum()), truncated.size) if n == 1 else None)
    return out
