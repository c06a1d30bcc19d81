"""`tidal grpo-orch`: the asyncio loop that turns prompts into training batches, one stage per module.

For step n = 1, 2, ...:
  1. gate and sample (`collect.sample_step`): wait until a policy m >= n - 1 - `max_async_level` is published
     and served (`policy.PolicyTracker`), then sample and score `batch_size / rollouts_per_example` groups of
     `rollouts_per_example` completions (`collect.collect_groups`; retried when the server restarts);
  2. assemble (`assemble.assemble`): rewards, advantages (`advantage.compute_advantages`), filters, the
     `TrainingBatch` and its metrics;
  3. hand over: `put` it on the batch sink (`rollouts/step_n` or zmq, `tidal.transport`);
  4. bookkeeping: the checkpoint every `ckpt.interval` steps (`ckpt`), samples to the sinks, and an
     evaluation when one is due (`evaluation`).
With `async_mode: in_flight`, step 1 takes the batch from a continuous group stream instead (`stream.GroupStream`:
policies load while requests run, stale groups are dropped; no drain between batches).
After `max_steps` batches the sink is finished (`rollouts/DONE`). With `ckpt.resume_step` it starts after the
restored step.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tidal.config.orch import OrchConfig
from tidal.inference.backends import make_client
from tidal.inference.protocol import InferenceClient, InferenceError
from tidal.monitor.metrics import MetricsWriter
from tidal.monitor.sinks import Sinks
from tidal.orchestrator.assemble import Assembled, assemble, pick_samples
from tidal.orchestrator.buffer import Buffer
from tidal.orchestrator.ckpt import Progress, resume_orch, save_orch
from tidal.orchestrator.collect import sample_step
from tidal.orchestrator.envmix import EnvMix
from tidal.orchestrator.evaluation import Evaluator
from tidal.orchestrator.filters import Filters
from tidal.orchestrator.groups import StepSample
from tidal.orchestrator.guide import reference_eos, resolved
from tidal.orchestrator.identity import IdentityCheck
from tidal.orchestrator.outage import Outage
from tidal.orchestrator.policy import PolicyTracker
from tidal.orchestrator.preflight import build_scoring, give_tools, teacher_url
from tidal.orchestrator.sampling import temperature_at
from tidal.orchestrator.scoring import RewardFunc, Scorer
from tidal.orchestrator.stream import GroupStream
from tidal.paths import eval_path
from tidal.transport import BatchSink
from tidal.transport.filesystem import BatchWriter
from tidal.transport.zmq_transport import ZmqBatchServer

log = logging.getLogger("tidal.orch")


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


@dataclass
class Parts:
    """What the loop works with, built from the config (and restored from a checkpoint when resuming)."""

    env: EnvMix
    scorer: Scorer
    buffer: Buffer
    filters: Filters
    custom: Any
    rng: random.Random
    progress: Progress
    client: InferenceClient
    teacher: InferenceClient | None
    sink: BatchSink
    sinks: Sinks

    @classmethod
    def build(cls, cfg: OrchConfig, run_dir: Path, reward_funcs: list[RewardFunc] | None = None,
              tooling: Any = None, rollout_func: Any = None) -> Parts:
        """`reward_funcs`: reward functions given in process (the Python API), after orch `reward_funcs`;
        `tooling`: tools given in process (`tidal.envs.tools.Tooling`) for the environments without their own;
        `rollout_func`: a rollout function given in process (`tidal.orchestrator.rollout_func.RolloutFunc`)."""
        scoring = build_scoring(cfg, reward_funcs, tooling, rollout_func)  # the checks `tidal grpo` runs up front, too
        env = scoring.env
        buffer = Buffer(cfg.buffer, cfg.dynamic_sampling)
        rng = random.Random(cfg.buffer.seed if cfg.buffer.seed is not None else cfg.seed)
        progress = resume_orch(run_dir, cfg.ckpt, rng, env, buffer)
        teacher = (make_client(cfg.client.model_copy(update={"base_url": [teacher_url(cfg)]}))
                   if cfg.teacher is not None else None)
        rt = cfg.rollout_transport
        sink: BatchSink = BatchWriter(run_dir) if rt.type == "filesystem" else ZmqBatchServer(rt.host, rt.port, rt.hwm)
        return cls(env, scoring.scorer, buffer, scoring.filters, scoring.custom, rng, progress,
                   make_client(cfg.client), teacher, sink,
                   Sinks(cfg.report_to, run_dir, {"orch": cfg.model_dump(mode="json")}))

    async def close(self) -> None:
        await self.sink.close()
        await self.client.close()
        if self.teacher is not None:
            await self.teacher.close()


async def served_base_model(client: InferenceClient, cfg: OrchConfig) -> str:
    """The base model's name on the server: orch `model.name`, checked against what the server lists (and, with
    orch `guide_flat_groups`, that its files name the EOS token a reference completion ends with: `guide`)."""
    served = await client.wait_ready()
    base = cfg.model.name or (served[0] if served else None)
    if base is None:
        raise ValueError("orch model.name is not set and the server lists no model")
    if served and base not in served:
        raise ValueError(f"orch model.name '{base}' is not served at {cfg.client.base_url[0]} "
                         f"(served: {', '.join(served)})")
    if cfg.guide_count():
        reference_eos(base)
    return base


def step_metrics(parts: Parts, got: StepSample, done: Assembled, counts: dict[str, float]) -> dict[str, float]:
    """Progress, buffer and timing metrics of a step (beside those of its batch); `timing/handoff_at`: the wall
    clock as the batch is handed over (the trainer turns it into `timing/handoff_s`)."""
    p = parts.progress
    return {**counts, **parts.buffer.metrics(), **parts.env.take_metrics(), "progress/total_tokens": p.total_tokens,
            "progress/total_samples": p.total_samples, "rollout_time_s": got.rollout_time_s,
            "weights_wait_s": got.waited_s, "timing/handoff_at": time.time(),
            "rollout_tokens_per_s": done.generated_tokens / max(got.rollout_time_s, 1e-9)}


def policy_tracker(cfg: OrchConfig, client: InferenceClient, base: str, run_dir: Path) -> PolicyTracker:
    """The run's `PolicyTracker`: which policy the server serves, loaded as orch `weight_broadcast` says."""
    wb = cfg.weight_broadcast
    return PolicyTracker(client, base, run_dir, cfg.model.lora_adapter, merged=wb.reload == "merged",
                         factors=wb.reload == "factors", pushed_timeout_s=wb.timeout if wb.type == "nccl" else None,
                         expect=(cfg.model.lora_rank, cfg.model.lora_alpha), await_base=wb.policy_zero == "published",
                         identity=IdentityCheck(wb.policy_check, wb.policy_check_tolerance, cfg.seq_len))


async def run(cfg: OrchConfig, run_dir: Path, reward_funcs: list[RewardFunc] | None = None,
              tooling: Any = None, stop: threading.Event | None = None, rollout_func: Any = None) -> int:
    """Produce batches until `max_steps`; returns the number written. `reward_funcs`: reward functions given in
    process (`tidal.api.GRPOTrainer`: closures and lambdas included), scored after orch `reward_funcs`;
    `tooling`: tools given in process (`GRPOTrainer(tools=..., environment_factory=...)`); `stop`: once set, no
    further batch is written and the run finishes as at `max_steps` (a TRL callback's `should_training_stop`);
    `rollout_func`: `GRPOTrainer(rollout_func=...)` (`tidal.orchestrator.rollout_func.RolloutFunc`) samples every
    group, training and eval."""
    parts = Parts.build(cfg, run_dir, reward_funcs, tooling, rollout_func)
    stream: GroupStream | None = None
    try:
        base = await served_base_model(parts.client, cfg)
        cfg = resolved(cfg, parts.env.envs, base)  # orch guide_flat_groups auto: on or off for this run, said once
        policy = policy_tracker(cfg, parts.client, base, run_dir)
        log.info("orchestrator ready: %s, %d prompts x %d rollouts per step, writing to %s", base,
                 cfg.batch_size // cfg.rollouts_per_example, cfg.rollouts_per_example, parts.sink.where)
        step = resumed_at = parts.progress.step
        evaluator = (Evaluator(cfg.eval, cfg.sampling, cfg.seq_len, MetricsWriter(eval_path(run_dir)), parts.scorer)
                     if cfg.eval is not None else None)
        if evaluator is not None:
            give_tools([env for env, _ in evaluator.sets.values()], tooling, rollout_func)
        skip_eval = resumed_at > 0 and cfg.eval is not None and cfg.eval.skip_eval_on_resume
        if evaluator is not None and resumed_at == 0 and evaluator.due(0):
            await policy.ensure(0, cfg.weights_timeout_s)  # policy 0: the trainer's, if it publishes one
            await evaluate(evaluator, parts.client, base, base, 0, 0, temperature_at(cfg.sampling, cfg.max_steps, 1),
                           parts.sinks)
        outage = Outage(cfg.env_outage, parts.env)  # one outage state per run, whichever group or step waits
        if cfg.async_mode == "in_flight":
            stream = GroupStream(cfg, parts.env, parts.rng, parts.client, base, policy, parts.scorer, parts.buffer,
                                 parts.teacher, step + 1,
                                 cfg.ckpt.wait_for_weights_timeout if resumed_at > 0 else None, outage)
            await stream.start()
        while (cfg.max_steps is None or step < cfg.max_steps) and not (stop is not None and stop.is_set()):
            step += 1
            # 1. gate and sample (in flight: take the batch from the stream)
            counts = dict.fromkeys(("prompts/skipped", "prompts/truncated", "inference_retries"), 0.0)
            if stream is not None:
                got = await stream.take(step, counts)
            else:
                got = await sample_step(step, cfg, parts.env, parts.rng, parts.client, base, policy, counts,
                                        parts.teacher, first_after_resume=step == resumed_at + 1 and resumed_at > 0,
                                        scorer=parts.scorer, buffer=parts.buffer, outage=outage)
            t_assemble = time.monotonic()  # 2. assemble
            done = assemble(step, got, cfg, parts.scorer, parts.filters, parts.custom)
            counts["timing/assemble_s"] = time.monotonic() - t_assemble
            progress = parts.progress
            progress.step, progress.total_tokens = step, progress.total_tokens + done.generated_tokens
            progress.total_samples += len(done.flat)
            done.batch.metrics |= step_metrics(parts, got, done, counts) | policy.identity.metrics()
            # 3. hand over (`timing/handoff_at` set by step_metrics: the trainer measures the hand-over from it)
            await parts.sink.put(done.batch)
            # 4. bookkeeping
            if cfg.ckpt.interval and step % cfg.ckpt.interval == 0:
                save_orch(run_dir, progress, parts.rng, cfg.ckpt, parts.env, parts.buffer)
            if parts.sinks.due(step) or step == cfg.max_steps:
                parts.sinks.record_samples(step, pick_samples(done.flat, done.rewards, done.advantages), done.rewards,
                                           np.concatenate([a for a in done.advantages if a.size] or [np.zeros(0)]))
            parts.sinks.forward_metrics()
            log.info("batch %d written: reward %.3f, policy %d, %d tokens in %.1f s%s", step,
                     done.batch.metrics["reward/mean"], policy.step, done.generated_tokens, got.rollout_time_s,
                     f", staleness max {done.batch.metrics['staleness/max']:.0f}" if stream is not None else "")
            if evaluator is not None and evaluator.due(policy.step):
                if skip_eval:
                    evaluator.skip(policy.step)
                else:
                    await evaluate(evaluator, parts.client, policy.model, base, policy.step, step,
                                   temperature_at(cfg.sampling, cfg.max_steps, step), parts.sinks)
            skip_eval = False
        if stream is not None:
            await stream.close()
        return await finish(parts, cfg, run_dir, step)
    finally:
        if stream is not None:
            await stream.close()
        await parts.close()


async def finish(parts: Parts, cfg: OrchConfig, run_dir: Path, step: int) -> int:
    """After the last batch: a last checkpoint, the DONE marker, and the sinks closed once the trainer is done."""
    if cfg.ckpt.interval and parts.progress.step == step and step % cfg.ckpt.interval:
        save_orch(run_dir, parts.progress, parts.rng, cfg.ckpt, parts.env, parts.buffer)  # a longer run resumes
    parts.sink.finish(step)
    log.info("all %d batches written; waiting for the trainer's last step before closing the sinks", step)
    await asyncio.get_running_loop().run_in_executor(None, lambda: parts.sinks.close(step, cfg.weights_timeout_s))
    log.info("orchestrator finished")
    return step
