"""Batch assembly: the sampled groups of one step -> rewards -> advantages -> filters -> `TrainingBatch`.

Rewards are the weighted sums of the reward functions (`combine_rewards`; a completion that every function scored
None gets 0 and is counted); advantages follow `advantage.*` (`compute_advantages`); enforced filters mask
completions out of the loss, and so does a failure on the environment's side (`Completion.env_error`: no loss,
advantage 0, out of every baseline and reward metric; `env/failed`, `env/dropped_groups`: `outage`). The batch holds
prompt + completion token ids per sample (loss on the completion's model tokens only; a rollout with several
training rows, `Completion.extra_rows` (an agent session's forks), is one sample per row, each row with the
rollout's reward, advantage and loss mask, `row_advantage`), vLLM's logprobs (each token's
true behaviour logprob, whatever policy sampled it: nothing recomputes them), the per-token advantages, the policy
versions that sampled each sample (`policy_steps`, start, and `policy_steps_end`; `staleness`) and the temperature
it was sampled at. A batch whose oldest policy lags more than `max_off_policy_steps` behind is written empty (its
samples dropped) so step numbering stays intact (gated mode; the in-flight stream drops stale groups before assembly
and waits for fresh ones). Staleness metrics (`staleness/*`, `dropped_stale`) come with every batch. The step's
orchestrator metrics ride along in `batch.metrics` (the trainer writes them to metrics.jsonl). Prompts with images
add the batch's image arrays (`image_arrays`: each distinct image once, shared by the completions of its prompt)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tidal.config.orch import OrchConfig
from tidal.envs.base import Example
from tidal.envs.images import text_of
from tidal.inference.protocol import Completion
from tidal.models.routes import batch_routes
from tidal.orchestrator.advantage import combine_rewards, compute_advantages
from tidal.orchestrator.distill import distill_metrics
from tidal.orchestrator.extend import sampled_mean
from tidal.orchestrator.filters import Filters
from tidal.orchestrator.groups import StepSample
from tidal.orchestrator.outage import judged
from tidal.orchestrator.sampling import max_completion_tokens, temperature_at
from tidal.orchestrator.scoring import Scorer
from tidal.orchestrator.staleness import staleness, staleness_metrics
from tidal.orchestrator.stats import rollout_metrics
from tidal.transport.batch import TrainingBatch

RESERVED_METRICS = frozenset({"step", "loss", "grad_norm", "tokens", "policy_step", "learning_rate", "entropy",
                              "mismatch_kl", "masked", "step_time_s"})
"""Metric names the trainer or the step bookkeeping writes; reward functions' `log_metric` may not take them."""

log = logging.getLogger("tidal.orch")


def image_arrays(prompts: list[list[int]], groups: list[list[Completion]],
                 images: list[list[bytes]]) -> dict[str, Any]:
    """The batch's image arrays (`TrainingBatch` module doc) for groups whose prompts hold `images` (PNG bytes
    per group); {} when no prompt has any."""
    if not any(images):
        return {}
    index: dict[bytes, int] = {}
    counts: list[int] = []
    refs: list[int] = []
    prompt_lengths: list[int] = []
    for prompt, comps, pngs in zip(prompts, groups, images, strict=True):
        ids = [index.setdefault(png, len(index)) for png in pngs]
        for _ in comps:
            counts.append(len(ids))
            refs += ids
            prompt_lengths.append(len(prompt))
    data = b"".join(index)
    return {"image_data": np.frombuffer(data, dtype=np.uint8),
            "image_lengths": np.array([len(png) for png in index], dtype=np.int64),
            "sample_images": np.array(refs, dtype=np.int32), "sample_image_counts": np.array(counts, dtype=np.int32),
            "prompt_lengths": np.array(prompt_lengths, dtype=np.int32)}


def build_batch(step: int, prompts: list[list[int]], groups: list[list[Completion]], rewards: np.ndarray,
                advantages: list[np.ndarray], versions: list[tuple[int, int]] | int, cfg: OrchConfig,
                teacher: list[list[float]] | None = None,
                masked: np.ndarray | None = None,
                images: list[list[bytes]] | None = None,
                dropped_stale: tuple[int, int] = (0, 0)) -> tuple[TrainingBatch, dict[str, Any]]:
    """Assemble the TrainingBatch (prompt + completion tokens, loss on the completion, none for completions
    `masked` by an enforced filter; the prompts' `images`, PNG bytes per group; `versions`, the (start, end)
    policy versions of each group, or the one policy that sampled them all) and its metrics; `dropped_stale`:
    (samples, groups) the stream dropped."""
    if isinstance(versions, int):
        versions = [(versions, versions)] * len(groups)
    comps = [(prompt, c) for prompt, cs in zip(prompts, groups, strict=True) for c in cs]
    group_of = [v for v, cs in zip(versions, groups, strict=True) for _ in cs]
    # (rollout index, prompt, completion) per sample: a rollout with `extra_rows` (an agent session's forks) is
    # several samples, each with the rollout's reward, advantage, loss mask and policy versions
    rows = [(k, p, x) for k, (prompt, c) in enumerate(comps) for p, x in c.training_rows(prompt)]
    starts = [group_of[k][0] for k, _, _ in rows]
    ends = [group_of[k][1] for k, _, _ in rows]
    policy_step = min(starts, default=max(0, step - 1))
    lag = staleness(step, policy_step)
    keep = lag <= cfg.max_off_policy_steps
    tokens: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    adv: list[np.ndarray] = []
    lengths: list[int] = []
    truncated: list[bool] = []
    token_versions: list[int] | None = [] if any(c.versions is not None for _, _, c in rows) else None
    for i, (k, prompt, c) in enumerate(rows):
        if token_versions is not None:  # partial rollouts: the version of each token (prompt: the sample's start)
            token_versions += [starts[i]] * len(prompt) + (c.versions or [starts[i]] * len(c.token_ids))
        tokens += prompt + c.token_ids
        keep_loss = 0 if masked is not None and masked[k] else 1
        mask += [0] * len(prompt) + [keep_loss * m for m in (c.mask or [1] * len(c.token_ids))]
        lps += [0.0] * len(prompt) + c.logprobs
        a = advantages[k]
        adv += [np.zeros(len(prompt)), a if c is comps[k][1] else np.full(len(c.token_ids), row_advantage(a))]
        lengths.append(len(prompt) + len(c.token_ids))
        truncated.append(c.finish_reason == "length")
    n = len(lengths)
    flat_adv = np.concatenate(adv) if adv else np.zeros(0)
    flat_teacher = np.concatenate([np.asarray(t) for t in teacher]) if teacher else None
    if not keep:  # every sample of this batch is too stale: an empty batch keeps step numbering intact
        tokens, mask, lps, lengths, truncated, flat_adv = [], [], [], [], [], np.zeros(0)
        flat_teacher = np.zeros(0) if teacher else None
    temperature = temperature_at(cfg.sampling, cfg.max_steps, step)
    batch = TrainingBatch(step=step, temperature=temperature, tokens=np.array(tokens),
                          lengths=np.array(lengths), loss_mask=np.array(mask), inference_logprobs=np.array(lps),
                          advantages=flat_adv, rewards=np.asarray(rewards)[[k for k, _, _ in rows]] if keep else
                          np.zeros(0),
                          policy_steps=np.array(starts if keep else [], dtype=np.int32),
                          policy_steps_end=np.array(ends if keep else [], dtype=np.int32),
                          truncated=np.array(truncated),
                          token_versions=None if token_versions is None else np.array(token_versions if keep else []),
                          max_tokens=max_completion_tokens(cfg.sampling, cfg.seq_len), teacher_logprobs=flat_teacher,
                          max_steps=cfg.max_steps,
                          routed_experts=batch_routes([(n, c.routed_experts if c.mask is None else None)
                                                       for n, (_, _, c) in zip(lengths, rows, strict=False)]),
                          **(image_arrays(prompts, groups, images) if keep and images else {}))
    metrics = {"advantage/abs_mean": float(np.mean([np.abs(a).mean() if a.size else 0.0 for a in advantages])),
               "seq_len/mean": float(np.mean(lengths or [0])), "samples": n, "dropped_off_policy": 0 if keep else n,
               "temperature": batch.temperature}  # policy_step, off_policy_level, max_steps: typed on the batch
    metrics |= staleness_metrics(step, starts, ends, dropped_stale[0] + (0 if keep else n),
                                 dropped_stale[1] + (0 if keep else len(groups)))
    return batch, metrics


def row_advantage(a: np.ndarray) -> float:
    """The advantage of a rollout's extra row (`Completion.extra_rows`): its main row's (constant for outcome
    advantages; the mean of its per-token advantages for process ones); 0 for a main row with no token."""
    return float(a.mean()) if a.size else 0.0


def pick_samples(flat: list[tuple[Example, Completion]], rewards: np.ndarray, advantages: list[np.ndarray],
                 limit: int = 8) -> list[dict[str, Any]]:
    """Up to `limit` samples spread over the batch, for samples.jsonl and the sinks."""
    every = max(1, len(flat) // limit)
    out = []
    for i in range(0, len(flat), every)[:limit]:
        ex, c = flat[i]
        user = [] if isinstance(ex.prompt, str) else [text_of(m["content"]) for m in ex.prompt
                                                      if m.get("role") == "user"]
        out.append({"prompt": user[-1] if user else str(ex.prompt), "completion": c.text,
                    "reward": float(rewards[i]),
                    "advantage": float(advantages[i].mean()) if advantages[i].size else 0.0})
    return out


@dataclass
class Assembled:
    """One step's batch and what the orchestrator reports about it."""

    batch: TrainingBatch
    flat: list[tuple[Example, Completion]]
    """(example, completion) per sample, in batch order."""
    rewards: np.ndarray
    advantages: list[np.ndarray]
    generated_tokens: int


def assemble(step: int, sample: StepSample, cfg: OrchConfig, scorer: Scorer, filters: Filters,
             custom: Callable[..., Any] | None) -> Assembled:
    """Rewards, advantages and filters of a sampled step, and its batch with the metrics that depend only on
    this step (the caller adds progress and timing)."""
    got = sample.collected
    per_func = np.concatenate(got.per_func)
    flat = [(ex, c) for ex, comps in zip(got.examples, got.groups, strict=True) for c in comps]
    ok = judged([c for _, c in flat])  # False: failed on the environment's side (NaN rows; `outage`)
    rewards, _ = combine_rewards(per_func, scorer.weights)
    rewards[~ok] = 0.0
    unscored = int((np.isnan(per_func).all(axis=1) & ok).sum()) if per_func.shape[1] else 0
    if unscored and cfg.advantage.type != "none":  # reward-free: nothing needs to score
        log.warning("step %d: %d completion(s) got None from every reward function; they score 0", step, unscored)
    comp_lens = np.array([len(c.token_ids) for _, c in flat])
    steps = ([scorer.step_rewards(ex, c) if c.env_error is None else [] for ex, c in flat]
             if cfg.advantage.type == "process" else None)
    pools = [(p.mean, p.std) if p is not None else None for p in got.pools] if any(got.pools) else None
    advantages = compute_advantages(cfg.advantage, cfg.rollouts_per_example, rewards, comp_lens, steps, custom, ok,
                                    per_func, scorer.weights, pools)
    masked, filter_metrics = filters.apply([c for _, c in flat])
    masked = masked | ~ok  # an unjudged rollout carries no loss
    batch, metrics = build_batch(step, got.prompts, got.groups, rewards, advantages, got.versions, cfg,
                                 sample.teacher, masked, got.images, sample.dropped_stale)
    metrics |= filter_metrics
    if sample.teacher is not None:
        metrics |= distill_metrics(batch, sample.teacher_time_s)
    metrics |= rollout_metrics(np.where(ok, rewards, np.nan), per_func, scorer.names, comp_lens,
                               np.array([c.finish_reason == "length" for _, c in flat]), cfg.rollouts_per_example)
    if cfg.extend_flat_groups or cfg.guide_count():
        metrics["reward/sampled_mean"] = sampled_mean(rewards, ok, cfg.rollouts_per_example, got.pools)
    metrics |= scorer.take_error_counts()
    metrics["completions/empty"] = float((comp_lens == 0).sum())
    metrics |= {"env/failed": float((~ok).sum()), "env/dropped_groups": float(got.env.dropped_groups)}
    metrics |= scorer.take_logged_metrics(set(metrics) | RESERVED_METRICS)
    batch.metrics = metrics
    return Assembled(batch, flat, rewards, advantages, int(comp_lens.sum()))
