"""More completions for groups with no learning signal (orch `extend_flat_groups`; gated batches).

A group whose judged rewards all agree trains on nothing: every advantage is 0. `extend_groups` samples
`rollouts_per_example` more completions of each such prompt, up to `extend_flat_groups` times, every flat group of a
round at once and by the policy that sampled the round, until the pooled rewards differ. `choose` then picks the
`rollouts_per_example` completions the group trains on: every completion whose reward differs from the first draw's,
up to half the group, the others of the first draw's reward, both at random (a `random.Random` seeded from orch
`seed`, the step and the group's index: reproducible). A `Pool` keeps what the advantages need: the pooled judged
rewards' mean and std, the baseline and the `scale_rewards: group` scale of the chosen completions
(`advantage.pooled_advantages`: an outcome seen once in m tries counts against 1/m), and the first draw's mean
(`reward/sampled_mean`: the policy's reward as it would read without extension).

Sampling seeds (`groups.sample_seed`): round j of the group numbered i in its batch samples with index
`EXTEND_INDEX + j * EXTEND_STRIDE + i`, apart from the first draws' indices and from the next batch's.
An environment whose reset gives a group's extension another prompt (its `prompt_ids` differ) cannot pool: that
group keeps its first draw, counted in `extend/prompt_changed` and said once. Counted per batch: `extend/groups`
(flat groups extended), `extend/found_signal` (those that ended with a signal), `extend/completions` (extra
completions sampled).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from tidal.config.orch import OrchConfig
from tidal.envs.base import Example
from tidal.inference.protocol import Completion, InferenceClient
from tidal.orchestrator.advantage import combine_rewards
from tidal.orchestrator.groups import Pool, group_rollouts
from tidal.orchestrator.outage import judged
from tidal.orchestrator.scoring import Scorer

log = logging.getLogger("tidal.orch")

EXTEND_INDEX = 50_000
EXTEND_STRIDE = 4_000
"""Seed indices of extension rounds (module doc); a batch's groups must number fewer than `EXTEND_STRIDE`."""
_SAID: set[str] = set()


def is_flat(rewards: np.ndarray, ok: np.ndarray) -> bool:
    """Whether the judged rewards (at least 2) all agree: a group with no signal."""
    r = np.asarray(rewards, dtype=np.float64)[np.asarray(ok, dtype=bool)]
    return r.size >= 2 and bool((r == r[0]).all())


def choose(rewards: np.ndarray, ok: np.ndarray, k: int, rng: random.Random) -> list[int]:
    """The `k` completions a pooled group trains on (module doc), as sorted indices into the pool, whose first `k`
    are the first draw (all of one judged reward): those whose judged reward differs from it, up to `k // 2` (at
    least 1 where there is one), then judged ones of the first draw's reward, then any left (more different ones,
    then unjudged), each at random."""
    r, ok = np.asarray(rewards, dtype=np.float64), np.asarray(ok, dtype=bool)
    first = r[:k][ok[:k]][0]
    other = [i for i in range(r.size) if ok[i] and r[i] != first]
    same = [i for i in range(r.size) if ok[i] and r[i] == first]
    take = rng.sample(other, min(len(other), max(1, k // 2))) if other else []
    take += rng.sample(same, min(len(same), k - len(take)))
    rest = [i for i in other if i not in take] + [i for i in range(r.size) if not ok[i]]
    take += rng.sample(rest, k - len(take)) if len(take) < k else []
    return sorted(take)


def pool_of(rewards: np.ndarray, ok: np.ndarray, k: int) -> Pool:
    """The baseline record of a pooled group (`groups.Pool`): judged rewards' mean, unbiased std, count, and the
    first draw's (first `k`) judged mean."""
    r = np.asarray(rewards, dtype=np.float64)[np.asarray(ok, dtype=bool)]
    first = np.asarray(rewards, dtype=np.float64)[:k][np.asarray(ok, dtype=bool)[:k]]
    return Pool(float(r.mean()), float(r.std(ddof=1)) if r.size >= 2 else 0.0, int(r.size), float(first.mean()))


async def extend_groups(step: int, cfg: OrchConfig, env: Any, client: InferenceClient, model: str,
                        examples: list[Example], prompts: list[list[int]], groups: list[list[Completion]],
                        scores: list[np.ndarray], images: list[list[bytes]], scorer: Scorer, first_index: int,
                        counts: dict[str, float]) -> tuple[list[list[Completion]], list[np.ndarray],
                                                           list[Pool | None]]:
    """The round's groups and scores with every flat group extended and chosen from (module doc), and each
    group's `Pool` (None: not pooled). `prompts`: the prompt ids the round was sampled from (an environment's reset
    may have changed a group's: its completions' `prompt_ids`); `first_index`: the batch index of the round's first
    group."""
    k = cfg.rollouts_per_example
    pooled_groups = [list(g) for g in groups]
    pooled_scores = [np.asarray(s) for s in scores]
    extended = [False] * len(groups)

    def flat(i: int) -> bool:
        return is_flat(combine_rewards(pooled_scores[i], scorer.weights)[0], judged(pooled_groups[i]))

    todo = [i for i in range(len(groups)) if flat(i)]
    for j in range(1, cfg.extend_flat_groups + 1):
        if not todo:
            break
        if first_index + len(groups) >= EXTEND_STRIDE:
            raise ValueError(f"extend_flat_groups: batch {step} has more than {EXTEND_STRIDE} groups")
        more = await asyncio.gather(*(
            group_rollouts(step, cfg, env, client, model, [examples[i]], [prompts[i]],
                           EXTEND_INDEX + j * EXTEND_STRIDE + first_index + i, [images[i]]) for i in todo))
        counts["extend/completions"] = counts.get("extend/completions", 0.0) + sum(len(m[0]) for m in more)
        for i, (g,) in zip(todo, more, strict=True):
            if g and (g[0].prompt_ids or prompts[i]) != (groups[i][0].prompt_ids or prompts[i]):
                counts["extend/prompt_changed"] = counts.get("extend/prompt_changed", 0.0) + 1
                if "prompt" not in _SAID:
                    _SAID.add("prompt")
                    log.warning("extend_flat_groups: environment '%s' gave the extension of a group another prompt "
                                "(its reset is not deterministic), so it cannot be pooled; that group trains on its "
                                "first draw (counted in extend/prompt_changed; said once)", examples[i].task or "?")
                continue
            extended[i] = True
            pooled_groups[i] += g
            pooled_scores[i] = np.concatenate([pooled_scores[i], scorer.score(examples[i], g, step)])
        todo = [i for i in todo if extended[i] and flat(i)]
    out_groups, out_scores = list(groups), [np.asarray(s) for s in scores]
    out_pools: list[Pool | None] = [None] * len(groups)
    for i in range(len(groups)):
        if not extended[i]:
            continue
        counts["extend/groups"] = counts.get("extend/groups", 0.0) + 1
        r, ok = combine_rewards(pooled_scores[i], scorer.weights)[0], judged(pooled_groups[i])
        if flat(i):  # still no signal: the first draw, as without extension
            continue
        counts["extend/found_signal"] = counts.get("extend/found_signal", 0.0) + 1
        idx = choose(r, ok, k, random.Random(f"{cfg.seed}/{step}/{first_index + i}"))
        out_groups[i] = [pooled_groups[i][t] for t in idx]
        out_scores[i] = pooled_scores[i][idx]
        out_pools[i] = pool_of(r, ok, k)
    return out_groups, out_scores, out_pools


def sampled_mean(rewards: np.ndarray, ok: np.ndarray, group_size: int, pools: Sequence[Pool | None]) -> float:
    """`reward/sampled_mean`: the mean over groups of each group's first-draw judged mean (a pooled group's
    `Pool.first_mean`; the trained completions' own otherwise; a group with none judged counts 0)."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1, group_size)
    j = np.asarray(ok, dtype=bool).reshape(-1, group_size)
    means = [p.first_mean if p is not None else float(r[g][j[g]].mean()) if j[g].any() else 0.0
             for g, p in enumerate(pools)]
    return float(np.mean(means)) if means else 0.0
