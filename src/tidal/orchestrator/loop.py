"""`tidal grpo-orch`: the asyncio loop that turns prompts into training batches.

For step n = 1, 2, ...:
  1. Policy lag: batch n may be sampled by a policy at most `max_async_level` (k) updates older than the one
     it trains, i.e. from policy m >= n - 1 - k (policy 0 is the base model, policy m is
     `broadcasts/step_m`). The newest STABLE broadcast is loaded into vLLM as LoRA adapter
     `{lora_adapter}-step-{m}`; the loop waits for one when the newest is too old. With k = 1, batch n+1 is
     sampled while the trainer trains on batch n.
  2. Sample `batch_size / rollouts_per_example` examples; for each, one request for `rollouts_per_example`
     completions (all in flight at once), from server-tokenized prompt ids.
  3. Score each completion (environment reward + `reward_funcs`, weighted); advantages per `advantage.*`.
  4. Drop samples whose lag exceeds `max_off_policy_steps`; write `rollouts/step_n` atomically, then the
     checkpoint of step n every `ckpt.interval` steps.
After `max_steps` batches it writes `rollouts/DONE`. With `ckpt.resume_step` it starts after the restored step
(`orchestrator.ckpt`); a step whose inference requests fail (server died or restarted) is sampled again once
the server answers, with the same examples and the policy loaded again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tidal.config.orch import OrchConfig
from tidal.envs.base import Example
from tidal.inference.client import Completion, InferenceClient, InferenceError
from tidal.monitor.metrics import MetricsWriter
from tidal.monitor.sinks import Sinks
from tidal.orchestrator.advantage import (
    combine_rewards,
    custom_advantages,
    group_advantages,
    load_function,
    process_advantages,
)
from tidal.orchestrator.buffer import Buffer
from tidal.orchestrator.ckpt import resume_orch, save_orch
from tidal.orchestrator.envmix import EnvMix
from tidal.orchestrator.evaluation import Evaluator
from tidal.orchestrator.filters import Filters
from tidal.orchestrator.rollout import multi_turn_group, rollout_group
from tidal.orchestrator.sampling import temperature_at
from tidal.orchestrator.scoring import Scorer
from tidal.orchestrator.stats import rollout_metrics
from tidal.trainer.broadcast import broadcast_dir, stable_steps
from tidal.transport.batch import TrainingBatch
from tidal.transport.filesystem import BatchWriter
from tidal.transport.zmq_transport import ZmqBatchServer

log = logging.getLogger("tidal.orch")


class PolicyTracker:
    """Which policy vLLM serves, and loading newer ones as the trainer broadcasts them.

    A broadcast is identified by its step and its STABLE marker's mtime, so a broadcast that a resumed trainer
    wrote again is loaded again. A restarted server (its `process_start_time_seconds` changed, or a request
    failed and `invalidate` was called) serves the base weights, so the current policy is loaded again."""

    def __init__(self, client: InferenceClient, base_model: str, run_dir: Path, prefix: str,
                 merged: bool = False, pushed_timeout_s: float | None = None,
                 expect: tuple[int | None, float | None] = (None, None)) -> None:
        self.client, self.base_model, self.run_dir, self.prefix = client, base_model, run_dir, prefix
        self.expect = expect  # orch model.lora_rank / lora_alpha: a broadcast adapter must match them
        self.merged = merged
        self.pushed_timeout_s = pushed_timeout_s  # set: the trainer pushes weights (weight_broadcast nccl)
        self.step = 0
        self.model = base_model
        self.loaded: tuple[int, int] = (0, 0)
        self.epochs: dict[str, float | None] | None = None

    def invalidate(self) -> None:
        """The server may have lost what was loaded (restart): load the policy again before the next request."""
        self.loaded, self.epochs = (-1, 0), None

    async def _check_restart(self) -> None:
        epochs = await self.client.server_epochs()
        if self.epochs is not None and epochs != self.epochs:
            log.warning("the inference server restarted (%s); policy %d goes onto it again", ", ".join(
                u for u in epochs if epochs[u] != self.epochs.get(u)), self.step)
            self.loaded = (-1, 0)
            self.model = self.base_model
        self.epochs = epochs

    async def ensure(self, required: int, timeout_s: float) -> float:
        """Serve the newest broadcast, waiting until it is >= `required`; returns seconds waited."""
        start, noted = time.monotonic(), time.monotonic()
        while True:
            steps = stable_steps(self.run_dir)
            newest = steps[-1] if steps else 0
            if newest >= required:
                break
            now = time.monotonic()
            if now - start > timeout_s:
                raise TimeoutError(f"policy {required} was not broadcast to {self.run_dir / 'broadcasts'} "
                                   f"within {timeout_s:.0f} s; is the trainer running? (weights_timeout_s; "
                                   f"restart the trainer with --resume, then this orchestrator with --resume)")
            if now - noted > 30:
                log.info("waiting for policy %d from the trainer for %.0f s", required, now - start)
                noted = now
            await asyncio.sleep(0.05)
        await self._check_restart()
        ident = (newest, self._stamp(newest)) if newest else (0, 0)
        if ident == self.loaded:
            return time.monotonic() - start
        if newest == 0:  # base model: nothing to load (a fresh server serves it)
            self.model, self.step, self.loaded = self.base_model, 0, ident
        elif self.pushed_timeout_s is not None:
            self.step = await self._await_push(newest)
            self.loaded = ident
        elif self.merged:
            path = broadcast_dir(self.run_dir, newest) / "merged"
            if not path.is_dir():
                raise FileNotFoundError(f"{path} is missing: weight_broadcast.reload is 'merged' but the trainer "
                                        f"does not write merged weights (set train broadcast_merged: true)")
            await self.client.reload_weights(str(path))
            self.step, self.loaded = newest, ident
        else:
            name = f"{self.prefix}-step-{newest}"
            check_adapter(broadcast_dir(self.run_dir, newest), *self.expect)
            await self.client.load_adapter(name, str(broadcast_dir(self.run_dir, newest)))
            old, self.model, self.step, self.loaded = self.model, name, newest, ident
            if old not in (self.base_model, name):
                await self.client.unload_adapter(old)
        return time.monotonic() - start

    async def _await_push(self, newest: int) -> int:
        """nccl: the trainer pushed policy `newest` before publishing it; check every server has it (a restarted
        one does not: ask the trainer to push again and wait). Returns the oldest version served."""
        from tidal.trainer.weight_push import request_push

        start, asked = time.monotonic(), False
        while True:
            versions = await self.client.weight_versions()
            behind = {u: v for u, v in versions.items() if v < newest}
            if not behind:
                return min(versions.values())
            if not asked:
                log.warning("inference server(s) %s serve weight version(s) %s, not policy %d (restarted?); asking "
                            "the trainer to push it again", ", ".join(behind), sorted(set(behind.values())), newest)
                request_push(self.run_dir, newest, f"behind: {behind}")
                asked = True
            assert self.pushed_timeout_s is not None
            if time.monotonic() - start > self.pushed_timeout_s:
                raise TimeoutError(f"inference server(s) {', '.join(behind)} still serve weight version(s) "
                                   f"{sorted(set(behind.values()))} instead of policy {newest} after "
                                   f"{self.pushed_timeout_s:.0f} s (weight_broadcast.timeout); is the trainer running "
                                   f"with weight_broadcast.type nccl and these servers in its base_url?")
            await asyncio.sleep(0.2)

    def _stamp(self, step: int) -> int:
        try:
            return (broadcast_dir(self.run_dir, step) / "STABLE").stat().st_mtime_ns
        except FileNotFoundError:
            return 0


def check_adapter(path: Path, rank: int | None, alpha: float | None) -> None:
    """Refuse a broadcast adapter whose rank or alpha differs from orch `model.lora_rank` / `lora_alpha` (when
    set): a trainer started with other LoRA settings than the ones this run was configured for."""
    if rank is None and alpha is None:
        return
    import json

    cfg_path = path / "adapter_config.json"
    got = json.loads(cfg_path.read_text())
    for key, want, have in (("lora_rank", rank, got.get("r")), ("lora_alpha", alpha, got.get("lora_alpha"))):
        if want is not None and have is not None and float(have) != float(want):
            raise ValueError(f"{cfg_path} has {key.split('_')[1]} {have} but orch model.{key} is {want}: the trainer "
                             f"runs with other LoRA settings than this orchestrator expects (fix one of them)")


MAX_DRAWS = 100


async def draw_prompts(env: Any, rng: random.Random, client: InferenceClient, model: str, n: int,
                       cfg: OrchConfig, counts: dict[str, float],
                       buffer: Buffer | None = None) -> tuple[list[Example], list[list[int]]]:
    """`n` examples (through `buffer`, when given: no duplicates, no pooled examples) and their prompt token
    ids. A prompt leaving no room under `seq_len` is skipped (another example is drawn) or truncated to its
    last tokens, per `long_prompts`; counted in `counts`."""
    def draw() -> Example:
        return buffer.draw(env, rng) if buffer is not None else env.sample(rng)

    examples = [draw() for _ in range(n)]
    prompts = list(await asyncio.gather(*(client.tokenize_chat(model, ex.prompt) for ex in examples)))
    reserve = min(cfg.sampling.max_tokens or max(1, cfg.seq_len // 4), cfg.seq_len // 2)
    for i in range(n):
        draws = 0
        while len(prompts[i]) >= cfg.seq_len:
            if cfg.long_prompts == "truncate":
                prompts[i] = prompts[i][-(cfg.seq_len - reserve):]
                counts["prompts/truncated"] = counts.get("prompts/truncated", 0.0) + 1
                break
            counts["prompts/skipped"] = counts.get("prompts/skipped", 0.0) + 1
            draws += 1
            if draws >= MAX_DRAWS:
                raise ValueError(f"{MAX_DRAWS} examples in a row were longer than seq_len {cfg.seq_len} tokens; "
                                 f"raise seq_len or set long_prompts: truncate")
            examples[i] = draw()
            prompts[i] = await client.tokenize_chat(model, examples[i].prompt)
    return examples, prompts


def compute_advantages(cfg: OrchConfig, rewards: np.ndarray, comp_lens: np.ndarray,
                       step_rewards: list[list[tuple[int, float]]] | None,
                       custom: Callable[..., Any] | None) -> list[np.ndarray]:
    """One per-token advantage array per completion, following `cfg.advantage`."""
    a, g = cfg.advantage, cfg.rollouts_per_example
    if a.type == "process":
        assert step_rewards is not None
        return process_advantages(step_rewards, [int(n) for n in comp_lens], g)
    if a.type == "custom":
        assert custom is not None and a.import_path is not None
        adv = custom_advantages(custom, a.import_path, rewards, comp_lens, g, a.kwargs or {})
    else:
        adv = group_advantages(rewards, g, a.scale_rewards, comp_lens, a.length_weighted_mean)
    return [np.full(int(n), v) for v, n in zip(adv, comp_lens, strict=True)]


def build_batch(step: int, prompts: list[list[int]], groups: list[list[Completion]], rewards: np.ndarray,
                advantages: list[np.ndarray], policy_step: int, cfg: OrchConfig,
                teacher: list[list[float]] | None = None,
                masked: np.ndarray | None = None) -> tuple[TrainingBatch, dict[str, Any]]:
    """Assemble the TrainingBatch (prompt + completion tokens, loss on the completion, none for completions
    `masked` by an enforced filter) and its metrics."""
    lag = (step - 1) - policy_step
    keep = lag <= cfg.max_off_policy_steps
    tokens: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    adv: list[np.ndarray] = []
    lengths: list[int] = []
    truncated: list[bool] = []
    comps = [(prompt, c) for prompt, cs in zip(prompts, groups, strict=True) for c in cs]
    for k, ((prompt, c), a) in enumerate(zip(comps, advantages, strict=True)):
        tokens += prompt + c.token_ids
        keep_loss = 0 if masked is not None and masked[k] else 1
        mask += [0] * len(prompt) + [keep_loss * m for m in (c.mask or [1] * len(c.token_ids))]
        lps += [0.0] * len(prompt) + c.logprobs
        adv += [np.zeros(len(prompt)), a]
        lengths.append(len(prompt) + len(c.token_ids))
        truncated.append(c.finish_reason == "length")
    n = len(lengths)
    flat_adv = np.concatenate(adv) if adv else np.zeros(0)
    flat_teacher = np.concatenate([np.asarray(t) for t in teacher]) if teacher else None
    if not keep:  # every sample of this batch is too stale: an empty batch keeps step numbering intact
        tokens, mask, lps, lengths, truncated, flat_adv = [], [], [], [], [], np.zeros(0)
        flat_teacher = np.zeros(0) if teacher else None
    batch = TrainingBatch(step=step, temperature=temperature_at(cfg, step), tokens=np.array(tokens),
                          lengths=np.array(lengths), loss_mask=np.array(mask), inference_logprobs=np.array(lps),
                          advantages=flat_adv, rewards=rewards if keep else np.zeros(0),
                          policy_steps=np.full(len(lengths), policy_step), truncated=np.array(truncated),
                          max_tokens=max_completion_tokens(cfg), teacher_logprobs=flat_teacher)
    metrics = {"advantage/abs_mean": float(np.mean([np.abs(a).mean() if a.size else 0.0 for a in advantages])),
               "seq_len/mean": float(np.mean(lengths or [0])), "off_policy_level": lag,
               "policy_step": policy_step, "samples": n, "dropped_off_policy": 0 if keep else n,
               "max_steps": cfg.max_steps, "temperature": batch.temperature}
    return batch, metrics


def pick_samples(flat: list[tuple[Example, Completion]], rewards: np.ndarray, advantages: list[np.ndarray],
                 limit: int = 8) -> list[dict[str, Any]]:
    """Up to `limit` samples spread over the batch, for samples.jsonl and the sinks."""
    every = max(1, len(flat) // limit)
    out = []
    for i in range(0, len(flat), every)[:limit]:
        ex, c = flat[i]
        user = [m["content"] for m in ex.prompt if m.get("role") == "user"]
        out.append({"prompt": user[-1] if user else str(ex.prompt), "completion": c.text,
                    "reward": float(rewards[i]),
                    "advantage": float(advantages[i].mean()) if advantages[i].size else 0.0})
    return out


def max_completion_tokens(cfg: OrchConfig) -> int:
    """The completion budget (dr_grpo's constant): `sampling.max_tokens`, else `seq_len`."""
    return cfg.sampling.max_tokens or cfg.seq_len


MAX_ATTEMPTS = 5


@dataclass
class Collected:
    """The groups chosen for one batch, with their scores."""

    examples: list[Example]
    prompts: list[list[int]]
    groups: list[list[Completion]]
    per_func: list[np.ndarray]
    """(G, K) rewards per reward function of each group."""


async def collect_groups(step: int, cfg: OrchConfig, env: Any, rng: random.Random, client: InferenceClient,
                         base: str, policy: PolicyTracker, counts: dict[str, float], scorer: Scorer,
                         buffer: Buffer) -> Collected:
    """Sample and score groups until the batch is full: one round without group filters; with them, rounds
    that ask for `oversampling_factor` x the groups still needed, keeping those the buffer accepts."""
    need = cfg.batch_size // cfg.rollouts_per_example
    kept = Collected([], [], [], [])
    spare = Collected([], [], [], [])
    requests = 0
    for _ in range(cfg.max_sampling_rounds if buffer.filtering else 1):
        buffer.counts["buffer/rounds"] += 1
        missing = need - len(kept.examples)
        ask = math.ceil(missing * cfg.oversampling_factor) if buffer.filtering else missing
        examples, prompts = await draw_prompts(env, rng, client, base, ask, cfg, counts, buffer)
        seeds = [None if cfg.sampling.seed is None else cfg.sampling.seed + step * 100003 + requests + i
                 for i in range(len(examples))]
        requests += len(examples)
        envs = [env.env_of(ex) if isinstance(env, EnvMix) else env for ex in examples]
        groups = await asyncio.gather(*(
            multi_turn_group(client, policy.model, p, cfg.rollouts_per_example, cfg, s, temperature_at(cfg, step),
                             e, ex) if e.max_turns > 1 else
            rollout_group(client, policy.model, p, cfg.rollouts_per_example, cfg, s, temperature_at(cfg, step))
            for p, s, e, ex in zip(prompts, seeds, envs, examples, strict=True)))
        for ex, p, g in zip(examples, prompts, groups, strict=True):
            scores = scorer.score(ex, g, step)
            ok = buffer.judge(ex, combine_rewards(scores, scorer.weights)[0])
            into = kept if ok and len(kept.examples) < need else spare
            if not ok:
                buffer.counts["buffer/dropped_groups"] += 1
            into.examples.append(ex)
            into.prompts.append(p)
            into.groups.append(g)
            into.per_func.append(scores)
        if len(kept.examples) >= need:
            break
    fill = need - len(kept.examples)
    if fill > 0:  # still short: top up with dropped groups so the batch keeps its size
        buffer.counts["buffer/filled_with_dropped"] += fill
        for field_ in ("examples", "prompts", "groups", "per_func"):
            getattr(kept, field_).extend(getattr(spare, field_)[:fill])
    return kept


async def sample_step(step: int, cfg: OrchConfig, env: Any, rng: random.Random, client: InferenceClient,
                      base: str, policy: PolicyTracker, counts: dict[str, float],
                      teacher: InferenceClient | None, first_after_resume: bool = False,
                      scorer: Scorer | None = None, buffer: Buffer | None = None) -> dict[str, Any]:
    """Prompts, completions, scores (and teacher logprobs) of batch `step`. A failed request (the server died
    or restarted) is retried after the server answers again, with the same examples and the policy reloaded.
    The first step after a resume waits `ckpt.wait_for_weights_timeout` (if set) for its policy."""
    state = rng.getstate()
    timeout = cfg.weights_timeout_s
    if first_after_resume and cfg.ckpt.wait_for_weights_timeout:
        timeout = cfg.ckpt.wait_for_weights_timeout
    buffer = buffer or Buffer(cfg)
    for attempt in range(1, MAX_ATTEMPTS + 1):
        try:
            if await client.discover():
                policy.invalidate()  # servers joined the elastic pool: load the policy on all of them
            waited = await policy.ensure(max(0, step - 1 - cfg.max_async_level), timeout)
            t0 = time.monotonic()
            buffer.new_step()
            assert scorer is not None
            got = await collect_groups(step, cfg, env, rng, client, base, policy, counts, scorer, buffer)
            out: dict[str, Any] = {"examples": got.examples, "prompts": got.prompts, "groups": got.groups,
                                   "per_func": got.per_func, "waited": waited,
                                   "rollout_time": time.monotonic() - t0, "teacher": None}
            if teacher is not None and cfg.teacher is not None:
                t1 = time.monotonic()
                seqs = [p + c.token_ids for p, comps in zip(got.prompts, got.groups, strict=True) for c in comps]
                out["teacher"] = await teacher.prompt_logprobs_many(cfg.teacher.model, seqs,
                                                                    cfg.teacher.max_concurrency)
                out["teacher_time"] = time.monotonic() - t1
            return out
        except InferenceError as exc:
            if attempt == MAX_ATTEMPTS:
                raise
            log.warning("step %d: inference request failed (%s); waiting for the server, then retrying the "
                        "step (attempt %d of %d)", step, str(exc)[:300], attempt + 1, MAX_ATTEMPTS)
            rng.setstate(state)
            for c in (client, teacher):
                if c is not None:
                    await c.wait_ready()
            policy.invalidate()
            counts["inference_retries"] = counts.get("inference_retries", 0.0) + 1
    raise AssertionError("unreachable")


async def evaluate(evaluator: Evaluator, client: InferenceClient, model: str, base: str, policy_step: int,
                   step: int, temperature: float, sinks: Sinks) -> None:
    try:
        out = await evaluator.run(client, model, base, policy_step, step, temperature)
    except InferenceError as exc:  # the next step's retry logic takes care of a dead server
        log.warning("eval of policy %d failed (%s); skipped", policy_step, str(exc)[:300])
        evaluator.skip(policy_step)
        return
    sinks.record_eval(out)
    means = ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in out.items() if k.endswith("/reward/mean"))
    log.info("eval of policy %d: reward %s (%.1f s)", policy_step, means, out["eval/time_s"])


async def run(cfg: OrchConfig, run_dir: Path) -> int:
    """Produce batches until `max_steps`; returns the number written."""
    env = EnvMix(cfg)
    scorer = Scorer(env.envs, cfg)
    buffer = Buffer(cfg)
    filters = Filters(cfg)
    custom = load_function(cfg.advantage.import_path) if cfg.advantage.import_path else None
    rng = random.Random(cfg.buffer.seed if cfg.buffer.seed is not None else cfg.seed)
    progress = resume_orch(run_dir, cfg, rng, env, buffer)
    client = InferenceClient(cfg.client)
    teacher = (InferenceClient(cfg.client.model_copy(update={"base_url": [cfg.teacher.base_url]}))
               if cfg.teacher is not None else None)
    rt = cfg.rollout_transport
    writer: Any = BatchWriter(run_dir) if rt.type == "filesystem" else ZmqBatchServer(rt.host, rt.port, rt.hwm)
    sinks = Sinks(cfg.report_to, run_dir, {"orch": cfg.model_dump(mode="json")})
    try:
        served = await client.wait_ready()
        base = cfg.model.name or (served[0] if served else None)
        if base is None:
            raise ValueError("orch model.name is not set and the server lists no model")
        if served and base not in served:
            raise ValueError(f"orch model.name '{base}' is not served at {cfg.client.base_url[0]} "
                             f"(served: {', '.join(served)})")
        wb = cfg.weight_broadcast
        policy = PolicyTracker(client, base, run_dir, cfg.model.lora_adapter, merged=wb.reload == "merged",
                               pushed_timeout_s=wb.timeout if wb.type == "nccl" else None,
                               expect=(cfg.model.lora_rank, cfg.model.lora_alpha))
        log.info("orchestrator ready: %s, %d prompts x %d rollouts per step, writing to %s", base,
                 cfg.batch_size // cfg.rollouts_per_example, cfg.rollouts_per_example, writer.dir)
        step = resumed_at = progress.step
        evaluator = (Evaluator(cfg, cfg.eval, MetricsWriter(run_dir / "eval.jsonl")) if cfg.eval is not None
                     else None)
        skip_eval = resumed_at > 0 and cfg.eval is not None and cfg.eval.skip_eval_on_resume
        if evaluator is not None and resumed_at == 0 and evaluator.due(0):
            await evaluate(evaluator, client, base, base, 0, 0, temperature_at(cfg, 1), sinks)
        while cfg.max_steps is None or step < cfg.max_steps:
            step += 1
            counts = dict.fromkeys(("prompts/skipped", "prompts/truncated", "inference_retries"), 0.0)
            got = await sample_step(step, cfg, env, rng, client, base, policy, counts, teacher,
                                    first_after_resume=step == resumed_at + 1 and resumed_at > 0,
                                    scorer=scorer, buffer=buffer)
            examples, prompts, groups = got["examples"], got["prompts"], got["groups"]
            per_func = np.concatenate(got["per_func"])
            rewards, unscored = combine_rewards(per_func, scorer.weights)
            if unscored:
                log.warning("step %d: %d completion(s) got None from every reward function; they score 0",
                            step, unscored)
            flat = [(ex, c) for ex, comps in zip(examples, groups, strict=True) for c in comps]
            comp_lens = np.array([len(c.token_ids) for _, c in flat])
            steps = ([scorer.step_rewards(ex, c) for ex, c in flat] if cfg.advantage.type == "process" else None)
            advantages = compute_advantages(cfg, rewards, comp_lens, steps, custom)
            masked, filter_metrics = filters.apply([c for _, c in flat])
            batch, metrics = build_batch(step, prompts, groups, rewards, advantages, policy.step, cfg,
                                         got["teacher"], masked)
            metrics |= filter_metrics
            if got["teacher"] is not None:
                metrics["teacher_time_s"] = got["teacher_time"]
            metrics |= rollout_metrics(rewards, per_func, scorer.names, comp_lens,
                                       np.array([c.finish_reason == "length" for _, c in flat]),
                                       cfg.rollouts_per_example)
            gen_tokens = int(comp_lens.sum())
            progress.step, progress.total_tokens = step, progress.total_tokens + gen_tokens
            progress.total_samples += len(flat)
            batch.metrics = {**metrics, **scorer.take_error_counts(), **counts, **buffer.metrics(),
                             "completions/empty": float((comp_lens == 0).sum()),
                             "progress/total_tokens": progress.total_tokens,
                             "progress/total_samples": progress.total_samples,
                             "rollout_time_s": got["rollout_time"], "weights_wait_s": got["waited"],
                             "rollout_tokens_per_s": gen_tokens / max(got["rollout_time"], 1e-9)}
            await writer.put(batch)
            if cfg.ckpt.interval and step % cfg.ckpt.interval == 0:
                save_orch(run_dir, progress, rng, cfg, env, buffer)
            if sinks.due(step) or step == cfg.max_steps:
                sinks.record_samples(step, pick_samples(flat, rewards, advantages), rewards,
                                     np.concatenate([a for a in advantages if a.size] or [np.zeros(0)]))
            sinks.forward_metrics()
            log.info("batch %d written: reward %.3f, policy %d, %d tokens in %.1f s", step,
                     metrics["reward/mean"], policy.step, gen_tokens, got["rollout_time"])
            if evaluator is not None and evaluator.due(policy.step):
                if skip_eval:
                    evaluator.skip(policy.step)
                else:
                    await evaluate(evaluator, client, policy.model, base, policy.step, step,
                                   temperature_at(cfg, step), sinks)
            skip_eval = False
        if cfg.ckpt.interval and progress.step == step and step % cfg.ckpt.interval:
            save_orch(run_dir, progress, rng, cfg, env, buffer)  # the last step too, so a longer run can resume
        writer.finish(step)
        log.info("all %d batches written; waiting for the trainer's last step before closing the sinks", step)
        await asyncio.get_running_loop().run_in_executor(None, lambda: sinks.close(step, cfg.weights_timeout_s))
        log.info("orchestrator finished")
        return step
    finally:
        await writer.close()
        await client.close()
        if teacher is not None:
            await teacher.close()
