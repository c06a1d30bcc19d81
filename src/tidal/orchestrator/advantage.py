"""Advantages and reward combination: pure numpy functions over one batch (formulas: docs/algorithms.md).

Rollouts are laid out group by group (`group_size` completions of the same prompt in a row).

- Outcome advantages: `A_i = (r_i - b_g) / s`, with `b_g` the group mean (or, with `length_weighted_mean`,
  the completion-length-weighted group mean) and `s` the group std (`scale_rewards: group`), the batch std
  (`batch`) or 1 (`none`); stds are unbiased (ddof 1) plus 1e-4, as in TRL.
- Process supervision (DeepSeekMath, seed 003): every step reward of a group is normalized by the mean/std
  of all step rewards of that group, and token t's advantage is the sum of the normalized rewards of the
  steps ending at or after t.
- Several reward functions: `r = sum_k w_k r_k` over the functions that returned a value (None -> skipped,
  TRL's semantics for multi-task data); a rollout no function scored gets 0.
- `multi_objective_aggregation: normalize_then_sum` (GDPO, TRL 1.16): each function's rewards are normalized
  within their group first (`(r_k - mean_k) / (std_k + 1e-4)`, NaN-aware), summed with the weights, and the sums
  normalized over the batch (`gdpo_advantages`); a rollout no function scored gets advantage 0.
- Rollouts failed on the environment's side (`judged` False: `tidal.orchestrator.outage`) take no part in any
  baseline or std and get advantage 0.
- Pooled groups (orch `extend_flat_groups`): a group chosen from a larger pool of completions takes the pool's
  judged mean as its baseline and, with `scale_rewards: group`, the pool's std (`pooled_advantages`).
- Custom: `import_path` names `module:function` (or `module.function`) called as
  `fn(rewards=..., lengths=..., group_size=..., **kwargs)`, returning one advantage per rollout.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tidal.config.orch import AdvantageSection

EPS = 1e-4


def _groups(values: np.ndarray, group_size: int) -> np.ndarray:
    if group_size < 1 or values.size % group_size:
        raise ValueError(f"{values.size} rewards do not split into groups of {group_size}")
    return values.reshape(-1, group_size)


def _std(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    """Unbiased std; 0 where there is a single value."""
    n = x.shape[axis] if axis is not None else x.size
    if n < 2:
        return np.zeros(x.shape[0] if axis == 1 else (), dtype=np.float64)
    return np.asarray(x.std(axis=axis, ddof=1))


def group_advantages(rewards: np.ndarray, group_size: int, scale_rewards: str = "none",
                     lengths: np.ndarray | None = None, length_weighted_mean: bool = False,
                     judged: np.ndarray | None = None) -> np.ndarray:
    """(N,) rewards -> (N,) outcome advantages (see module doc). `judged` (N,) bool: only those rollouts enter
    their group's baseline and the stds; the others (failed on the environment's side: `outage`) get 0."""
    r = _groups(np.asarray(rewards, dtype=np.float64), group_size)
    if judged is not None and not np.asarray(judged, dtype=bool).all():
        return _judged_advantages(r, _groups(np.asarray(judged, dtype=bool), group_size), scale_rewards, lengths,
                                  length_weighted_mean)
    if length_weighted_mean:
        if lengths is None:
            raise ValueError("length_weighted_mean needs the completion lengths")
        w = _groups(np.asarray(lengths, dtype=np.float64), group_size)
        base = (w * r).sum(axis=1, keepdims=True) / np.maximum(w.sum(axis=1, keepdims=True), 1.0)
    else:
        base = r.mean(axis=1, keepdims=True)
    adv = r - base
    if scale_rewards == "group":
        adv = adv / (_std(r, axis=1)[:, None] + EPS)
    elif scale_rewards == "batch":
        adv = adv / (_std(r.reshape(-1)) + EPS)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be group, batch or none, got {scale_rewards!r}")
    return adv.reshape(-1)


def pooled_advantages(adv: np.ndarray, rewards: np.ndarray, group_size: int,
                      pools: Sequence[tuple[float, float] | None], scale_rewards: str = "none",
                      judged: np.ndarray | None = None) -> np.ndarray:
    """`group_advantages`' (N,) `adv` with each group that was chosen from a larger pool (orch `extend_flat_groups`:
    `pools[g]` is (mean, std) of its pooled judged rewards, None for the others) taken against the pool:
    `(r_i - mean) / s` with `s` the pool's std + EPS (`group`), the batch's judged std + EPS (`batch`, as
    `group_advantages` takes it) or 1 (`none`); unjudged rollouts 0."""
    r = _groups(np.asarray(rewards, dtype=np.float64), group_size)
    j = np.ones(r.shape, dtype=bool) if judged is None else _groups(np.asarray(judged, dtype=bool), group_size)
    if len(pools) != r.shape[0]:
        raise ValueError(f"{len(pools)} pools for {r.shape[0]} groups")
    out = _groups(np.array(adv, dtype=np.float64), group_size).copy()
    batch_std = _std(r[j]) + EPS
    for g, pool in enumerate(pools):
        if pool is None:
            continue
        mean, std = pool
        scale = {"group": std + EPS, "batch": batch_std, "none": 1.0}.get(scale_rewards)
        if scale is None:
            raise ValueError(f"scale_rewards must be group, batch or none, got {scale_rewards!r}")
        out[g] = np.where(j[g], (r[g] - mean) / scale, 0.0)
    return out.reshape(-1)


def _judged_advantages(r: np.ndarray, j: np.ndarray, scale_rewards: str, lengths: np.ndarray | None,
                       length_weighted_mean: bool) -> np.ndarray:
    """`group_advantages` over the judged rollouts `j` (G groups, n) only; 0 for the others."""
    if length_weighted_mean and lengths is None:
        raise ValueError("length_weighted_mean needs the completion lengths")
    r = np.where(j, r, 0.0)  # an unjudged rollout's reward (NaN or reward_default) takes no part
    w = j * (_groups(np.asarray(lengths, dtype=np.float64), r.shape[1]) if length_weighted_mean else 1.0)
    base = (w * r).sum(axis=1, keepdims=True) / np.maximum(w.sum(axis=1, keepdims=True),
                                                           1.0 if length_weighted_mean else 1e-300)
    adv = r - base
    count = j.sum(axis=1)
    if scale_rewards == "group":
        mean = (j * r).sum(axis=1) / np.maximum(count, 1)
        var = (j * (r - mean[:, None]) ** 2).sum(axis=1) / np.maximum(count - 1, 1)
        adv = adv / (np.where(count >= 2, np.sqrt(var), 0.0)[:, None] + EPS)
    elif scale_rewards == "batch":
        adv = adv / (_std(r[j]) + EPS)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be group, batch or none, got {scale_rewards!r}")
    return np.where(j, adv, 0.0).reshape(-1)


def process_advantages(step_rewards: Sequence[Sequence[tuple[int, float]]], completion_lengths: Sequence[int],
                       group_size: int) -> list[np.ndarray]:
    """Per-token advantages from step rewards: `step_rewards[i]` lists (end token index, reward) of
    completion i's steps (0-based index into the completion). Returns one (len_i,) array per completion."""
    n = len(step_rewards)
    if n != len(completion_lengths) or group_size < 1 or n % group_size:
        raise ValueError(f"{n} step-reward lists for {len(completion_lengths)} completions in groups of "
                         f"{group_size}")
    out: list[np.ndarray] = []
    for g in range(0, n, group_size):
        pooled = np.array([r for i in range(g, g + group_size) for _, r in step_rewards[i]], dtype=np.float64)
        mean = pooled.mean() if pooled.size else 0.0
        std = _std(pooled) + EPS
        for i in range(g, g + group_size):
            adv = np.zeros(completion_lengths[i], dtype=np.float64)
            for end, r in step_rewards[i]:
                if not 0 <= end < completion_lengths[i]:
                    raise ValueError(f"step end {end} outside completion {i} of {completion_lengths[i]} tokens")
                adv[: end + 1] += (r - mean) / std
            out.append(adv)
    return out


def combine_rewards(per_func: np.ndarray, weights: Sequence[float]) -> tuple[np.ndarray, int]:
    """(N, K) rewards with NaN for None -> ((N,) weighted sums over the non-None entries, rows with none)."""
    r = np.asarray(per_func, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if r.ndim != 2 or r.shape[1] != len(w):
        raise ValueError(f"{r.shape} rewards for {len(w)} weights")
    unscored = int(np.isnan(r).all(axis=1).sum())
    return np.nansum(r * w, axis=1), unscored


def _nanstd(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    """TRL's `nanstd`: unbiased std over the non-NaN entries (NaN with fewer than 2)."""
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices: NaN, as in torch
        mean = np.nanmean(x, axis=axis, keepdims=True)
        var = np.nanmean((x - mean) ** 2, axis=axis, keepdims=True)
        count = (~np.isnan(x)).sum(axis=axis, keepdims=True)
        return np.asarray(np.sqrt(var * (count / (count - 1))))


def gdpo_advantages(per_func: np.ndarray, weights: Sequence[float], group_size: int) -> np.ndarray:
    """(N, K) rewards (NaN: the function returned None) -> (N,) advantages of TRL 1.16's `normalize_then_sum`
    (GDPO): every function's rewards normalized within each group, summed with `weights` (NaN terms skipped),
    then normalized by the batch mean and std; a row no function scored gets 0. `scale_rewards` plays no part."""
    r = np.asarray(per_func, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if r.ndim != 2 or r.shape[1] != len(w):
        raise ValueError(f"{r.shape} rewards for {len(w)} weights")
    if group_size < 1 or r.shape[0] % group_size:
        raise ValueError(f"{r.shape[0]} rewards do not split into groups of {group_size}")
    grouped = r.reshape(-1, group_size, r.shape[1])
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean_k = np.nanmean(grouped, axis=1, keepdims=True)
        std_k = _nanstd(grouped, axis=1) if group_size > 1 else np.zeros_like(mean_k)
        reward_k = ((grouped - mean_k) / (std_k + EPS)).reshape(-1, r.shape[1])
        total = np.nansum(reward_k * w, axis=1)
        total[np.isnan(r).all(axis=1)] = np.nan
        std = _nanstd(total) if total.size > 1 else np.zeros_like(total)
        adv = (total - np.nanmean(total)) / (std + EPS)
    return np.nan_to_num(adv, nan=0.0)


MOVED = {"tidal.reward_model": "tidal.rewards.model", "tidal.sandbox": "tidal.rewards.sandbox"}
"""tidal modules that config files named by import path before they moved into packages (2026-12): the old path is
refused with the new one."""


def load_function(import_path: str) -> Callable[..., Any]:
    """`pkg.mod:fn` or `pkg.mod.fn` -> the function; errors name the path."""
    mod_name, sep, attr = import_path.partition(":")
    if not sep:
        mod_name, _, attr = import_path.rpartition(".")
    if not mod_name or not attr:
        raise ValueError(f"import path {import_path!r} must look like 'package.module:function'")
    if mod_name in MOVED:
        raise ValueError(f"import path {import_path!r}: tidal's module {mod_name} is now {MOVED[mod_name]}; write "
                         f"'{MOVED[mod_name]}:{attr}'")
    try:
        fn = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import {import_path!r}: {exc}") from exc
    if not callable(fn):
        raise ValueError(f"{import_path!r} is not callable")
    return fn  # type: ignore[no-any-return]


def custom_advantages(fn: Callable[..., Any], import_path: str, rewards: np.ndarray, lengths: np.ndarray,
                      group_size: int, kwargs: dict[str, Any]) -> np.ndarray:
    """Call a user advantage function and check it returned one finite value per rollout."""
    out = np.asarray(fn(rewards=np.asarray(rewards, dtype=np.float64), lengths=np.asarray(lengths),
                        group_size=group_size, **kwargs), dtype=np.float64)
    if out.shape != (len(rewards),):
        raise ValueError(f"advantage function {import_path} returned shape {out.shape}, expected "
                         f"({len(rewards)},)")
    if not np.isfinite(out).all():
        raise ValueError(f"advantage function {import_path} returned non-finite values")
    return out


def compute_advantages(advantage: AdvantageSection, group_size: int, rewards: np.ndarray, comp_lens: np.ndarray,
                       step_rewards: list[list[tuple[int, float]]] | None,
                       custom: Callable[..., Any] | None, judged: np.ndarray | None = None,
                       per_func: np.ndarray | None = None,
                       weights: Sequence[float] | None = None,
                       pools: Sequence[tuple[float, float] | None] | None = None) -> list[np.ndarray]:
    """One per-token advantage array per completion, following orch `advantage` (`type`: group-relative,
    process rewards, or a custom function); completions come in groups of `group_size`. `judged` (N,) bool: the
    rollouts the environment judged; the others (`outage`) get advantage 0 and stay out of every baseline (a
    custom function sees their group's judged mean as their reward). `per_func` (N, K) and `weights`: the
    rewards of each function, for `multi_objective_aggregation: normalize_then_sum`. `pools`: per group, (mean, std)
    of the pool it was chosen from (`pooled_advantages`; the default type only)."""
    j = np.ones(len(comp_lens), dtype=bool) if judged is None else np.asarray(judged, dtype=bool)
    if advantage.type == "none":  # reward-free distillation: the trainer's teacher term is the whole signal
        return [np.zeros(int(n)) for n in comp_lens]
    if advantage.type == "process":
        assert step_rewards is not None
        steps = [s if ok else [] for s, ok in zip(step_rewards, j, strict=True)]
        return process_advantages(steps, [int(n) for n in comp_lens], group_size)
    if advantage.type == "custom":
        assert custom is not None and advantage.import_path is not None
        r = np.asarray(rewards, dtype=np.float64)
        if not j.all():  # an unjudged rollout takes its group's judged mean: it moves neither mean nor sum
            g, jg = _groups(r, group_size), _groups(j, group_size)
            means = np.where(jg, g, 0.0).sum(axis=1, keepdims=True) / np.maximum(jg.sum(axis=1, keepdims=True), 1)
            r = np.where(jg, g, means).reshape(-1)
        adv = custom_advantages(custom, advantage.import_path, r, comp_lens, group_size, advantage.kwargs or {})
        adv = np.where(j, adv, 0.0)
    elif advantage.multi_objective_aggregation == "normalize_then_sum":
        if per_func is None or weights is None:
            raise ValueError("normalize_then_sum needs each reward function's rewards and the weights")
        rows = np.where(j[:, None], np.asarray(per_func, dtype=np.float64), np.nan)  # unjudged: unscored
        adv = gdpo_advantages(rows, weights, group_size)
    else:
        adv = group_advantages(rewards, group_size, advantage.scale_rewards, comp_lens, advantage.length_weighted_mean,
                               j)
        if pools is not None and any(p is not None for p in pools):
            if advantage.length_weighted_mean:
                raise ValueError("pooled baselines (orch extend_flat_groups) need length_weighted_mean false")
            adv = pooled_advantages(adv, rewards, group_size, pools, advantage.scale_rewards, j)
    return [np.full(int(n), v) for v, n in zip(adv, comp_lens, strict=True)]
