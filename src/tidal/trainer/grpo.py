"""The GRPO training loop (`tidal grpo-train`): batch n in, policy n out.

For step n = 1, 2, ...: wait for `rollouts/step_n` -> pack into micro-batches -> for each micro-batch,
forward (logprobs at the rollouts' temperature), GRPO loss, backward -> clip, AdamW step, LR schedule ->
(`weight_broadcast.type: nccl`: push policy n into the vLLM servers) -> publish `broadcasts/step_n` -> append
the step's metrics (the orchestrator's, carried in the batch, plus the trainer's) to `metrics.jsonl`. Stops at
`max_steps` or when the orchestrator writes `rollouts/DONE`.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tidal.assets import resolve_model
from tidal.config.train import TrainConfig, TrainWeightBroadcast
from tidal.monitor.metrics import MetricsWriter, progress_line
from tidal.paths import metrics_path
from tidal.trainer.broadcast import checkpoint_keys, publish_adapter
from tidal.trainer.health import MismatchGuard
from tidal.trainer.logprobs import forward_logprobs, forward_logprobs_entropy
from tidal.trainer.loss import LossInputs, LossScale, LossSums, policy_loss
from tidal.trainer.model import load_policy
from tidal.trainer.optim import make_optimizer, make_scheduler
from tidal.trainer.packing import MicroBatch, pack, packing_efficiency
from tidal.transport import BatchSource, weights
from tidal.transport.batch import TrainingBatch
from tidal.transport.filesystem import BatchReader

log = logging.getLogger("tidal.trainer")


def _ref_logprobs(model: torch.nn.Module, mb: MicroBatch, temperature: float, chunk_size: int) -> torch.Tensor:
    """Reference policy = the base model: the same PEFT model with its adapters disabled (no copy); loss tokens
    only (the loss reads no other)."""
    with torch.no_grad(), model.disable_adapter():  # type: ignore[operator]
        return forward_logprobs(model, mb.input_ids, mb.position_ids, temperature, chunk_size=chunk_size,
                                loss_mask=mb.loss_mask)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: TrainingBatch, cfg: TrainConfig,
               device: torch.device, pad_id: int) -> dict[str, Any]:
    """`loss.num_iterations` optimizer steps on `batch`; returns the trainer's metrics for it."""
    lc = cfg.loss
    micro = [mb.to(device) for mb in pack(batch, cfg.sequence_len, cfg.per_device_train_batch_size, pad_id,
                                          drop_truncated=lc.mask_truncated_completions)]
    if lc.teacher_tau and batch.teacher_logprobs is None:
        raise ValueError(f"train loss.teacher_tau is {lc.teacher_tau} but batch {batch.step} carries no teacher "
                         f"logprobs; configure the orchestrator's `teacher`")
    scale = LossScale(step_tokens=max(sum(float(mb.loss_mask.sum()) for mb in micro), 1.0),
                      step_sequences=batch.num_samples, micro_batches=len(micro),
                      max_completion_len=batch.max_tokens or int(batch.lengths.max(initial=1)))
    old: list[torch.Tensor] = []
    ref: list[torch.Tensor | None] = []
    sums, loss_total, norms = LossSums(), 0.0, []
    params = [p for p in model.parameters() if p.requires_grad]
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
    for it in range(lc.num_iterations):
        for k, mb in enumerate(micro):
            lp, ent = forward_logprobs_entropy(model, mb.input_ids, mb.position_ids, batch.temperature,
                                               chunk_size=cfg.logprob_chunk_size, loss_mask=mb.loss_mask)
            if it == 0:  # the old policy of every iteration is the trainer at the start of the step
                old.append(lp.detach())
                ref.append(_ref_logprobs(model, mb, batch.temperature, cfg.logprob_chunk_size) if lc.beta else None)
            inputs = LossInputs(logprobs=lp, old_logprobs=old[k], inference_logprobs=mb.inference_logprobs,
                                advantages=mb.advantages, loss_mask=mb.loss_mask, seq_ids=mb.seq_ids,
                                ref_logprobs=ref[k], teacher_logprobs=mb.teacher_logprobs, entropy=ent)
            loss, s = policy_loss(inputs, lc, scale)
            loss.backward()
            sums += s
            loss_total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    tokens = max(sums["tokens"], 1.0)
    trunc = batch.truncated.astype(bool) if batch.truncated is not None else np.zeros(0, dtype=bool)
    completion_tokens = float(batch.loss_mask.sum())
    truncated_tokens = sum(int(batch.loss_mask[s].sum()) for s, t in zip(batch.samples(), trunc, strict=True) if t)
    clipped = [min(n, max_norm) for n in norms]  # seed 000: grad_norm is the norm after clipping
    out: dict[str, Any] = {"loss": loss_total / lc.num_iterations, "grad_norm": float(np.mean(clipped)),
                           "grad_norm/pre_clip": float(np.mean(norms)),
                           "tokens": int(sums["tokens"] / lc.num_iterations),
                           "micro_batches": len(micro), "packing_efficiency": packing_efficiency(micro),
                           "processed_tokens": sum(mb.num_tokens for mb in micro) * lc.num_iterations}
    out |= {k: v / tokens for k, v in sums.items() if k != "tokens" and (k != "kl" or lc.beta)}
    out["masked/truncated"] = (truncated_tokens / max(completion_tokens, 1.0)
                               if lc.mask_truncated_completions else 0.0)
    return out


def _note_wait(step: int, seconds: float) -> None:
    log.info("waiting for batch %d from the orchestrator for %.0f s", step, seconds)


def optimizer_steps(opt: torch.optim.Optimizer) -> int:
    """AdamW's own step counter (restored from a checkpoint on resume, 0 for a fresh optimizer)."""
    for state in opt.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def resume(resume_step: int | None, run_dir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
           sched: torch.optim.lr_scheduler.LRScheduler, merged_keys: list[str] | None, keep: int) -> int:
    """Restore checkpoint `resume_step` (train `ckpt.resume_step`; -1: the newest; None: start fresh) and
    rewind the run directory, keeping `keep` policies; returns the restored step."""
    from tidal.checkpoint import CheckpointError, resolve_resume_step
    from tidal.paths import ckpt_root
    from tidal.trainer.ckpt import COMPONENT, load_trainer, rewind_run_dir

    step = resolve_resume_step(run_dir, COMPONENT, resume_step)
    if step is None:
        if resume_step is not None and (weights.stable_steps(run_dir) or metrics_path(run_dir).exists()):
            raise CheckpointError(f"cannot resume: {run_dir} holds trained steps but no trainer checkpoint under "
                                  f"{ckpt_root(run_dir, COMPONENT)} (set train ckpt.interval to write them)")
        if resume_step is not None:
            log.info("resume requested but %s holds no trainer checkpoint and no trained step: starting fresh",
                     run_dir)
        return 0
    load_trainer(run_dir, step, model, opt, sched)
    rewind_run_dir(run_dir, step, model, merged_keys, keep=keep)
    log.info("resumed from checkpoint step %d (optimizer step %d, lr %.3g); next batch: %d", step,
             optimizer_steps(opt), sched.get_last_lr()[0], step + 1)
    return step


def make_pusher(wb: TrainWeightBroadcast, device: torch.device) -> Any:
    """The weight pusher for train `weight_broadcast.type: nccl`, else None."""
    if wb.type != "nccl":
        return None
    from tidal.trainer.weight_push import WeightPusher

    return WeightPusher(wb.base_url, wb.host, wb.port, wb.timeout, os.environ.get(wb.api_key_var), device)


def push_policy(pusher: Any, model: torch.nn.Module, run_dir: Path, step: int) -> float:
    """Push policy `step` into the inference servers; a failure (a server died) is logged, not fatal: the
    orchestrator asks for the policy again once the server is back (`serve_push_request`)."""
    try:
        seconds = pusher.push(model, step)
    except Exception as exc:  # noqa: BLE001 - inference may be restarting; the orchestrator asks again
        log.warning("could not push policy %d into inference (%r); it is pushed again when the orchestrator "
                    "asks for it", step, exc)
        return 0.0
    asked = weights.push_requested(run_dir)
    if asked is not None and asked <= step:
        weights.clear_push_request(run_dir)
    return seconds


def serve_push_request(pusher: Any, model: torch.nn.Module, run_dir: Path, step: int) -> None:
    """While waiting for a batch: push the current policy (`step`) again if the orchestrator asked for it."""
    asked = weights.push_requested(run_dir)
    if asked is None or asked > step or step == 0:
        return
    if pusher.failures == 0:
        log.info("the orchestrator asked for policy %d again (an inference server restarted); pushing policy %d",
                 asked, step)
    try:
        pusher.push(model, step)
    except Exception as exc:  # noqa: BLE001 - tried again on the next poll
        if pusher.failures % 15 == 0:
            log.warning("could not push policy %d yet (%r); retrying every 2 s", step, exc)
        pusher.failures += 1
        time.sleep(2.0)
        return
    log.info("pushed policy %d again", step)
    pusher.failures = 0
    weights.clear_push_request(run_dir)


@dataclass
class Policy:
    """The model being trained and what steps it."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    device: torch.device
    tokenizer: Any
    pad_id: int


def build_policy(cfg: TrainConfig, total_steps: int | None) -> Policy:
    """The LoRA policy, AdamW and the LR schedule per `cfg` (before any resume)."""
    from tidal.trainer.model import load_tokenizer

    tok = load_tokenizer(cfg.model)
    model, device = load_policy(cfg)
    opt = make_optimizer(model, cfg)
    sched = make_scheduler(opt, cfg.lr_scheduler_type, cfg.warmup_steps, total_steps)
    return Policy(model, opt, sched, device, tok, tok.pad_token_id if tok.pad_token_id is not None else 0)


def open_source(cfg: TrainConfig, run_dir: Path) -> BatchSource:
    """Where batches come from: `rollouts/` (filesystem) or the orchestrator's zmq server."""
    if cfg.transport_type == "zmq":
        from tidal.transport.zmq_transport import ZmqBatchReader

        return ZmqBatchReader(cfg.transport_host, cfg.transport_port)
    return BatchReader(run_dir)


def train_and_publish(step: int, batch: TrainingBatch, p: Policy, cfg: TrainConfig, run_dir: Path, pusher: Any,
                      merged_keys: list[str] | None) -> dict[str, Any]:
    """Trainer step `step` on `batch`, then push (nccl) and publish policy `step`, and checkpoint every
    `ckpt.interval` steps; returns the trainer's metrics with their timings."""
    from tidal.trainer.ckpt import save_trainer

    t0 = time.monotonic()
    tm = train_step(p.model, p.opt, batch, cfg, p.device, p.pad_id)
    lr = p.sched.get_last_lr()[0]
    p.sched.step()
    train_time = time.monotonic() - t0
    push_time = push_policy(pusher, p.model, run_dir, step) if pusher else 0.0
    publish_adapter(p.model, run_dir, step, keep=cfg.max_async_level + 2, merged_keys=merged_keys)
    ckpt_time = 0.0
    if cfg.ckpt.interval and step % cfg.ckpt.interval == 0:
        t1 = time.monotonic()
        save_trainer(run_dir, step, p.model, p.opt, p.sched, cfg.ckpt)
        ckpt_time = time.monotonic() - t1
    return {**tm, "lr": lr, "optimizer_steps": optimizer_steps(p.opt), "train_time_s": train_time,
            "broadcast_time_s": time.monotonic() - t0 - train_time - ckpt_time, "ckpt_time_s": ckpt_time,
            **({"push_time_s": push_time} if pusher else {}),
            "trainer_tokens_per_s": tm["processed_tokens"] / max(train_time, 1e-9)}


def finish(p: Policy, cfg: TrainConfig, run_dir: Path, step: int, resumed_from: int) -> None:
    """After the last step: a final checkpoint, the exports (`export.*`) and the run report."""
    from tidal.trainer.ckpt import save_trainer
    from tidal.trainer.export import export_final

    if cfg.ckpt.interval and step > resumed_from and step % cfg.ckpt.interval:
        save_trainer(run_dir, step, p.model, p.opt, p.sched, cfg.ckpt)  # the last step too: a longer run resumes
    log.info("trainer finished after %d steps; metrics in %s", step, metrics_path(run_dir))
    if step > 0:
        for what, path in export_final(p.model, p.tokenizer, cfg.export, cfg.model, run_dir).items():
            log.info("final %s: %s", what, path)
    try:
        from tidal.monitor.report import write_report

        log.info("run report: %s", write_report(run_dir))
    except Exception as exc:  # noqa: BLE001 - a failed report must not fail a finished run
        log.warning("could not write the run report: %r (retry with `tidal report %s`)", exc, run_dir)


def run(cfg: TrainConfig, run_dir: Path) -> int:
    """Train until `max_steps` or the orchestrator's DONE; returns the number of steps trained."""
    if not cfg.lora:
        raise ValueError("grpo-train needs lora: true (full-weight broadcasts are not supported yet)")
    total = cfg.max_steps if cfg.max_steps > 0 else None
    p = build_policy(cfg, total)
    merged_keys = checkpoint_keys(resolve_model(cfg.model)) if cfg.broadcast_merged else None
    source = open_source(cfg, run_dir)
    step = resumed_from = resume(cfg.ckpt.resume_step, run_dir, p.model, p.opt, p.sched, merged_keys,
                                 keep=cfg.max_async_level + 2)
    pusher = make_pusher(cfg.weight_broadcast, p.device)
    metrics = MetricsWriter(metrics_path(run_dir))
    log.info("trainer ready on %s: %s trainable parameters; waiting for batches in %s", p.device,
             f"{sum(q.numel() for q in p.model.parameters() if q.requires_grad):,}", source.where)
    guard = MismatchGuard(cfg.mismatch_guard)
    step_times: list[float] = []
    last_done = time.monotonic()
    while total is None or step < total:
        wait_start = time.monotonic()
        on_tick = functools.partial(serve_push_request, pusher, p.model, run_dir, step) if pusher else None
        batch = source.wait(step + 1, cfg.batch_timeout_s, on_wait=functools.partial(_note_wait, step + 1),
                            on_tick=on_tick)
        if batch is None:
            break
        step += 1
        if batch.step != step:
            raise ValueError(f"batch {step} from {source.where} holds step {batch.step}")
        waited = time.monotonic() - wait_start
        record = {"step": step, **batch.metrics, "resumed_from": resumed_from, "wait_time_s": waited,
                  **train_and_publish(step, batch, p, cfg, run_dir, pusher, merged_keys)}
        now = time.monotonic()
        record["step_time_s"], last_done = now - last_done, now
        metrics.write(record)
        guard.check(step, record)
        step_times.append(record["step_time_s"])
        if step % cfg.logging_steps == 0 or step == total:
            goal = total or batch.metrics.get("max_steps")
            eta = (goal - step) * sum(step_times[-5:]) / len(step_times[-5:]) if goal else None
            log.info(progress_line(record, goal, eta))
    if pusher is not None:
        pusher.close()
    finish(p, cfg, run_dir, step, resumed_from)
    return step
