"""The GRPO training loop (`tidal grpo-train`): batch n in, policy n out.

For step n = 1, 2, ...: wait for `rollouts/step_n` -> pack into micro-batches -> for each micro-batch,
forward (logprobs at the rollouts' temperature), GRPO loss, backward -> clip, AdamW step, LR schedule ->
publish `broadcasts/step_n` -> append the step's metrics (the orchestrator's, carried in the batch, plus the
trainer's) to `metrics.jsonl`. Stops at `max_steps` or when the orchestrator writes `rollouts/DONE`.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any

import torch

from tidal.config.train import TrainConfig
from tidal.monitor.metrics import MetricsWriter, progress_line
from tidal.trainer.broadcast import publish_adapter
from tidal.trainer.logprobs import forward_logprobs
from tidal.trainer.loss import LossSums, grpo_loss
from tidal.trainer.model import load_policy
from tidal.trainer.optim import make_optimizer, make_scheduler
from tidal.trainer.packing import pack, packing_efficiency
from tidal.transport.batch import TrainingBatch
from tidal.transport.filesystem import BatchReader

log = logging.getLogger("tidal.trainer")


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: TrainingBatch, cfg: TrainConfig,
               device: torch.device, pad_id: int) -> dict[str, Any]:
    """One optimizer step on `batch`; returns the trainer's metrics for it."""
    micro = pack(batch, cfg.sequence_len, cfg.per_device_train_batch_size, pad_id)
    loss_scale = max(float(batch.loss_mask.sum()), 1.0)
    sums, loss_total = LossSums(), 0.0
    for mb in micro:
        mb = mb.to(device)
        lp = forward_logprobs(model, mb.input_ids, mb.position_ids, batch.temperature)  # (B, T)
        loss, s = grpo_loss(lp, mb.inference_logprobs, mb.advantages, mb.loss_mask, mb.seq_ids, cfg.loss,
                            loss_scale)
        loss.backward()
        sums += s
        loss_total += float(loss.detach())
    params = [p for p in model.parameters() if p.requires_grad]
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    opt.step()
    opt.zero_grad(set_to_none=True)
    tokens = max(sums.tokens, 1.0)
    return {"loss": loss_total, "grad_norm": grad_norm, "tokens": int(sums.tokens),
            "mismatch_kl": sums.mismatch_kl / tokens, "masked": sums.masked / tokens,
            "masked/token": sums.masked_token / tokens, "masked/sequence": sums.masked_sequence / tokens,
            "micro_batches": len(micro), "packing_efficiency": packing_efficiency(micro),
            "processed_tokens": sum(mb.num_tokens for mb in micro)}


def _note_wait(step: int, seconds: float) -> None:
    log.info("waiting for batch %d from the orchestrator for %.0f s", step, seconds)


def run(cfg: TrainConfig, run_dir: Path) -> int:
    """Train until `max_steps` or the orchestrator's DONE; returns the number of steps trained."""
    from tidal.trainer.model import load_tokenizer

    if not cfg.lora:
        raise ValueError("grpo-train needs lora: true (full-weight broadcasts are not supported yet)")
    tok = load_tokenizer(cfg.model)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    model, device = load_policy(cfg)
    opt = make_optimizer(model, cfg)
    total = cfg.max_steps if cfg.max_steps > 0 else None
    sched = make_scheduler(opt, cfg, total)
    reader, metrics = BatchReader(run_dir), MetricsWriter(run_dir / "metrics.jsonl")
    log.info("trainer ready on %s: %s trainable parameters; waiting for batches in %s", device,
             f"{sum(p.numel() for p in model.parameters() if p.requires_grad):,}", reader.dir)
    step, last_done = 0, time.monotonic()
    while total is None or step < total:
        wait_start = time.monotonic()
        batch = reader.wait(step + 1, cfg.batch_timeout_s, on_wait=functools.partial(_note_wait, step + 1))
        if batch is None:
            break
        step += 1
        if batch.step != step:
            raise ValueError(f"{reader.dir}/step_{step}.safetensors holds step {batch.step}")
        t0 = time.monotonic()
        tm = train_step(model, opt, batch, cfg, device, pad_id)
        lr = sched.get_last_lr()[0]
        sched.step()
        train_time = time.monotonic() - t0
        publish_adapter(model, run_dir, step, keep=cfg.max_async_level + 2)
        now = time.monotonic()
        record: dict[str, Any] = {"step": step, **batch.metrics, **tm, "lr": lr,
                                  "train_time_s": train_time, "wait_time_s": t0 - wait_start,
                                  "broadcast_time_s": now - t0 - train_time, "step_time_s": now - last_done,
                                  "trainer_tokens_per_s": tm["processed_tokens"] / max(train_time, 1e-9)}
        last_done = now
        metrics.write(record)
        if step % cfg.logging_steps == 0 or step == total:
            log.info(progress_line(record, total or batch.metrics.get("max_steps")))
    log.info("trainer finished after %d steps; metrics in %s", step, metrics.path)
    return step
