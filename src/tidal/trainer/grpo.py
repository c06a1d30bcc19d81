"""The GRPO training loop (`tidal grpo-train`): batch n in, policy n out.

For step n = 1, 2, ...: wait for `rollouts/step_n` -> pack into micro-batches -> cut them into optimizer steps
(`gradient_accumulation_steps` per rank, or `steps_per_generation`) spread over the trainer ranks
(`tidal.trainer.step.schedule`) -> per micro-batch: forward (logprobs at the rollouts' temperature), GRPO loss,
backward; per optimizer step: clip, AdamW step at its point of the LR schedule -> (`weight_broadcast.type:
nccl`: push policy n into the vLLM servers) -> publish `broadcasts/step_n` -> append the step's metrics (the
orchestrator's, carried in the batch, plus the trainer's, reduced over the ranks) to `metrics.jsonl`. Stops at
`max_steps` or when the orchestrator writes `rollouts/DONE`. With several ranks (`gpus`), every rank runs this
loop and rank 0 alone reads batches and publishes (`tidal.trainer.distributed`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tidal.config.train import TrainConfig
from tidal.models.arch import skips_backward
from tidal.models.families import ONE_PER_ROW, packing_rule
from tidal.models.memory import train_footprint_gib
from tidal.models.sources import resolve_model
from tidal.monitor.metrics import MetricsWriter, progress_line
from tidal.paths import metrics_path
from tidal.trainer.distributed import (
    SINGLE,
    Ranks,
    broadcast_batch,
    broadcast_int,
    grad_norm,
    reduce_values,
    reshard,
    set_gradient_sync,
)
from tidal.trainer.memory import peak_gib, reset_peak
from tidal.trainer.model import kernels, router_replay
from tidal.trainer.model.attention import flat_rows_blocker, prompt_sharing_blocker, uses_flex
from tidal.trainer.model.attention.flex import compiled_graphs
from tidal.trainer.model.noise import qerl_noise
from tidal.trainer.model.quant import qlora_kind
from tidal.trainer.model.vision import attach_images
from tidal.trainer.policy import Policy, build_policy, restore, save, sync_view
from tidal.trainer.preflight import check_train
from tidal.trainer.profile import OPTIMIZER
from tidal.trainer.publish.broadcast import changed_keys, checkpoint_keys, publish_adapter, publish_base
from tidal.trainer.publish.probe import Prober
from tidal.trainer.publish.push import Pusher, make_pusher
from tidal.trainer.step import ref_sync
from tidal.trainer.step.entropy_control import EntropyControl
from tidal.trainer.step.health import MismatchGuard
from tidal.trainer.step.logprobs import forward_logprobs, forward_logprobs_entropy
from tidal.trainer.step.loss import (
    PER_SEQUENCE,
    LossInputs,
    LossScale,
    LossSums,
    advantage_only,
    policy_loss,
    zero_gradient,
)
from tidal.trainer.step.packing import FLAT_MAX_TOKENS, MicroBatch, pack, packing_efficiency, shared_tokens
from tidal.trainer.step.schedule import OptimizerStep, plan
from tidal.transport import BatchSource, weights
from tidal.transport.batch import TrainingBatch
from tidal.transport.filesystem import BatchReader

log = logging.getLogger("tidal.trainer")


def _ref_logprobs(model: torch.nn.Module, mb: MicroBatch, temperature: float, chunk_size: int,
                  reference: torch.nn.Module | None = None) -> torch.Tensor:
    """Reference policy = the base model: the same PEFT model with its adapters disabled (no copy), or the frozen
    `reference` of a fully fine-tuned policy; loss tokens only (the loss reads no other). PEFT re-enables the
    adapters by setting `requires_grad` on the parameters the model holds at that moment: under FSDP they must
    be the kept shards, not a gathered copy (`reshard`)."""
    if reference is not None:
        with torch.no_grad():
            return forward_logprobs(reference, mb.input_ids, mb.position_ids, temperature, chunk_size=chunk_size,
                                    loss_mask=mb.loss_mask, images=mb.images, attention_mask=mb.mask_for(reference))
    with torch.no_grad(), model.disable_adapter():  # type: ignore[operator]
        lp = forward_logprobs(model, mb.input_ids, mb.position_ids, temperature, chunk_size=chunk_size,
                              loss_mask=mb.loss_mask, images=mb.images, attention_mask=mb.mask_for(model))
        reshard(model)
    return lp


def _sequences(micro: list[MicroBatch], members: list[int]) -> int:
    """Samples in the micro-batches `members` (a sample never spans two rows)."""
    ids = torch.cat([micro[i].seq_ids.flatten() for i in members])
    return int(torch.unique(ids[ids >= 0]).numel())


def _set_lr(opt: torch.optim.Optimizer, sched: Any, offset: float) -> None:
    """The schedule's learning rate at `offset` (in [0, 1)) into the current training step: the k-th of K
    optimizer steps of a training step takes the schedule at (step - 1) + k / K."""
    for group, base, factor in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
        group["lr"] = base * factor(sched.last_epoch + offset)


def _old_logprobs(model: torch.nn.Module, micro: list[MicroBatch], steps: list[OptimizerStep], ranks: Ranks,
                  temperature: float, chunk: int) -> dict[int, torch.Tensor]:
    """With several optimizer steps per iteration, the policy at the start of the training step scores the later
    steps' micro-batches before the first update (every slot runs: FSDP needs equal passes on every rank)."""
    old: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for st in steps[1:]:
            for i in st.slots[ranks.rank]:
                router_replay.use(model, micro[i].routed_experts)
                old[i] = forward_logprobs(model, micro[i].input_ids, micro[i].position_ids, temperature,
                                          chunk_size=chunk, loss_mask=micro[i].loss_mask, images=micro[i].images,
                                          attention_mask=micro[i].mask_for(model))
    if old and ranks.sharded:
        reshard(model)
    return old


def _upfront_ref_logprobs(model: torch.nn.Module, micro: list[MicroBatch], temperature: float, cfg: TrainConfig,
                          reference: torch.nn.Module | None) -> dict[int, torch.Tensor | None]:
    """With `loss.sync_ref_model` (one rank): every micro-batch's reference logprobs before the step's first update,
    which may move the reference (TRL scores the whole generation batch first); else {} (filled lazily)."""
    if not (cfg.loss.beta and cfg.loss.sync_ref_model):
        return {}
    return {i: _ref_logprobs(model, mb, temperature, cfg.logprob_chunk_size, reference) for i, mb in enumerate(micro)}


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: TrainingBatch, cfg: TrainConfig,
               device: torch.device, pad_id: int, *, ranks: Ranks = SINGLE, sched: Any = None,
               reference: torch.nn.Module | None = None, entropy: EntropyControl | None = None) -> dict[str, Any]:
    """One training step on `batch`: its micro-batches cut into optimizer steps (`gradient_accumulation_steps` /
    `steps_per_generation`, spread over the ranks: `tidal.trainer.step.schedule`), `loss.num_iterations` times;
    with `sched`, each optimizer step takes its own point of the LR schedule. Returns the trainer's metrics,
    reduced over the ranks."""
    lc = cfg.loss
    ec = entropy or EntropyControl(lc.entropy_coef)  # the entropy bonus's coefficient (adaptive: across steps)
    skippable = (cfg.skip_zero_gradient and ranks.world == 1
                 and skips_backward(model_config(model), batch.image_data is not None))
    micro, steps = _packed(model, batch, cfg, pad_id, ranks, skippable)
    micro = [mb.to(device) for mb in micro]
    attach_images(model, batch, micro, resolve_model(cfg.model), cfg.model, cfg.trust_remote_code)
    if lc.teacher_tau and batch.teacher_logprobs is None:
        raise ValueError(f"train loss.teacher_tau is {lc.teacher_tau} but batch {batch.step} carries no teacher "
                         f"logprobs; configure the orchestrator's `teacher`")
    router_replay.prepare(model, cfg.router_replay, batch.routed_experts is not None, batch.step)
    max_len = batch.max_tokens or int(batch.lengths.max(initial=1))
    scales = [LossScale(step_tokens=max(sum(float(micro[i].loss_mask.sum()) for i in st.micro), 1.0),
                        step_sequences=batch.num_samples if len(steps) == 1 else _sequences(micro, st.micro),
                        micro_batches=len(st.micro), max_completion_len=max_len) for st in steps]
    old = _old_logprobs(model, micro, steps, ranks, batch.temperature, cfg.logprob_chunk_size)
    ref = _upfront_ref_logprobs(model, micro, batch.temperature, cfg, reference)
    sums, loss_total, norms = LossSums(), 0.0, []
    clip = {"clip_ratio/low_min": float("inf"), "clip_ratio/high_max": float("-inf")}
    params = [p for p in model.parameters() if p.requires_grad]
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
    total = len(steps) * lc.num_iterations
    skipped_total = 0
    for it in range(lc.num_iterations):
        for g, st in enumerate(steps):
            if sched is not None:
                _set_lr(opt, sched, (it * len(steps) + g) / total)
            slots, real, skipped = st.slots[ranks.rank], st.real[ranks.rank], 0
            for j, (i, counted) in enumerate(zip(slots, real, strict=True)):
                mb = micro[i]
                router_replay.use(model, mb.routed_experts)  # kept through the backward (checkpoint recompute)
                if it == 0:  # no-grad passes before the graph is built (FSDP: its backward follows its forward)
                    r = (_ref_logprobs(model, mb, batch.temperature, cfg.logprob_chunk_size, reference)
                         if lc.beta else None)
                    ref.setdefault(i, r)
                skip = skippable and zero_gradient(mb.advantages, mb.loss_mask, lc)
                with torch.no_grad() if skip else contextlib.nullcontext():  # skipped: the metrics only
                    loss, s = _micro_loss(model, mb, i, it == 0, batch.temperature, cfg, old, ref[i], scales[g], ec)
                set_gradient_sync(model, cfg.zero_level, j == len(slots) - 1)
                skipped += skip
                if not skip:
                    (loss if counted else loss * 0.0).backward()
                if not counted:  # a padding slot (see tidal.trainer.step.schedule): same keys, nothing counted
                    sums += dict.fromkeys(s, 0.0)
                    continue
                sums += s
                ec.add(s)
                loss_total += float(loss.detach())
                n = max(s["tokens"], 1.0)
                clip["clip_ratio/low_min"] = min(clip["clip_ratio/low_min"], s["clip_ratio/low_mean"] / n)
                clip["clip_ratio/high_max"] = max(clip["clip_ratio/high_max"], s["clip_ratio/high_mean"] / n)
            norms.append(_optimizer_step(opt, params, max_norm, skipped > 0, functools.partial(
                _after_optimizer_step, opt, lc, ec, ranks, model, reference)))
            skipped_total += skipped
    out = _step_metrics(batch, cfg, micro, ranks, total, reduce_values(ranks, dict(sums)),
                        reduce_values(ranks, {"loss": loss_total})["loss"], norms, clip)
    out |= router_replay.step_metrics(model, lambda v: reduce_values(ranks, v))
    out["micro_batches/skipped"] = skipped_total
    if lc.use_adaptive_entropy:  # TRL's `entropy_coef`: the coefficient after this step's updates
        out["entropy_coef"] = ec.coef
    if uses_flex(model):  # graphs flex_attention compiled so far (this rank); bounded: attention/flex.py
        out["flex_graphs"] = compiled_graphs()
    if cfg.compile_layers:  # graphs of the compiled decoder layers (bounded per layer class: model/kernels)
        out["layer_graphs"] = kernels.compiled_graphs()
    return out


def _micro_loss(model: torch.nn.Module, mb: MicroBatch, i: int, first: bool, temperature: float, cfg: TrainConfig,
                old: dict[int, torch.Tensor], ref: torch.Tensor | None, scale: LossScale,
                ec: EntropyControl) -> tuple[torch.Tensor, LossSums]:
    """Micro-batch `i`'s forward and policy loss with its metric sums; in the `first` iteration its logprobs become
    its old logprobs (the trainer at the start of the step) unless `old` has them already."""
    lc = cfg.loss
    lp, ent = forward_logprobs_entropy(model, mb.input_ids, mb.position_ids, temperature,
                                       chunk_size=cfg.logprob_chunk_size, loss_mask=mb.loss_mask,
                                       images=mb.images, attention_mask=mb.mask_for(model),
                                       entropy_grad=bool(lc.entropy_coef or lc.use_adaptive_entropy))
    if first:
        old.setdefault(i, lp.detach())
    inputs = LossInputs(logprobs=lp, old_logprobs=old[i], inference_logprobs=mb.inference_logprobs,
                        advantages=mb.advantages, loss_mask=mb.loss_mask, seq_ids=mb.seq_ids,
                        ref_logprobs=ref, teacher_logprobs=mb.teacher_logprobs, entropy=ent)
    return policy_loss(inputs, lc, scale, ec.applied(lc))


def _after_optimizer_step(opt: torch.optim.Optimizer, lc: Any, ec: EntropyControl, ranks: Ranks,
                          model: torch.nn.Module, reference: torch.nn.Module | None) -> None:
    """The entropy controller's step and TR-DPO's reference sync, after each optimizer step."""
    ec.step(lc, lambda v: reduce_values(ranks, v))
    ref_sync.after_optimizer_step(lc, optimizer_steps(opt), model, reference)


def _optimizer_step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], max_norm: float, skipped: bool,
                    after: Any) -> float:
    """Clip, step, `after()` (the entropy controller, TR-DPO's reference sync), zero the gradients; returns the
    pre-clip norm. `skipped`: a micro-batch's backward was skipped (train `skip_zero_gradient`), so a parameter
    with no gradient gets the zero one that backward would have given it (AdamW still decays its moments)."""
    if skipped:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    with torch.profiler.record_function(OPTIMIZER):  # tidal.trainer.profile's "optimizer" row
        norm = grad_norm(torch.nn.utils.clip_grad_norm_(params, max_norm))
        opt.step()
        after()
        opt.zero_grad(set_to_none=True)
    return norm


def _packed(model: torch.nn.Module, batch: TrainingBatch, cfg: TrainConfig, pad_id: int, ranks: Ranks,
            skippable: bool) -> tuple[list[MicroBatch], list[OptimizerStep]]:
    """The batch's micro-batches and optimizer steps. With `skippable` (train `skip_zero_gradient`) and one optimizer
    step, the samples whose loss has zero gradient are packed apart from the others, so that their micro-batches
    skip the backward, unless that would take a second optimizer step (the samples of each step would change),
    the loss is `bnpo` (normalized per micro-batch) or `loss.top_entropy_quantile` < 1 (the entropy mask takes its
    quantile per micro-batch, so other neighbours would train other tokens). Either way the update is the one
    without the skip; without the repacking only micro-batches that happen to hold no gradient skip."""
    def packed(apart: list[bool] | None) -> tuple[list[MicroBatch], list[OptimizerStep]]:
        mbs = pack(batch, cfg.sequence_len, cfg.per_device_train_batch_size, pad_id,
                   drop_truncated=cfg.loss.mask_truncated_completions, max_tokens=cfg.micro_batch_tokens,
                   share_prompts=shares_prompts(model, cfg, batch), apart=apart,
                   one_per_row=packing_rule(model.config) == ONE_PER_ROW, flat=flat_rows(model, batch))
        return mbs, plan([mb.input_ids.numel() for mb in mbs], ranks.world, cfg.gradient_accumulation_steps,
                         cfg.steps_per_generation)

    micro, steps = packed(None)
    if not (skippable and len(steps) == 1 and cfg.loss.loss_type != "bnpo" and advantage_only(cfg.loss)
            and cfg.loss.top_entropy_quantile >= 1):
        return micro, steps
    zero = [not np.any(batch.advantages[s][batch.loss_mask[s].astype(bool)] != 0) for s in batch.samples()]
    if not any(zero) or all(zero):
        return micro, steps
    alt, alt_steps = packed(zero)
    return (alt, alt_steps) if len(alt_steps) == 1 else (micro, steps)


def model_config(model: torch.nn.Module) -> dict[str, Any]:
    """The model's config as a config.json dict (`tidal.models` reads it; {} for a module without one)."""
    config = getattr(model, "config", None)
    return config.to_dict() if config is not None else {}


def _step_metrics(batch: TrainingBatch, cfg: TrainConfig, micro: list[MicroBatch], ranks: Ranks, optim_steps: int,
                  sums: dict[str, float], loss_total: float, norms: list[float],
                  clip: dict[str, float]) -> dict[str, Any]:
    """The trainer's metrics of a step from its (rank-reduced) sums."""
    lc, max_norm = cfg.loss, cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
    tokens = max(sums["tokens"], 1.0)
    trunc = batch.truncated.astype(bool) if batch.truncated is not None else np.zeros(0, dtype=bool)
    completion_tokens = float(batch.loss_mask.sum())
    truncated_tokens = sum(int(batch.loss_mask[s].sum()) for s, t in zip(batch.samples(), trunc, strict=True) if t)
    clipped = [min(n, max_norm) for n in norms]  # seed 000: grad_norm is the norm after clipping
    out: dict[str, Any] = {"loss": loss_total / optim_steps, "grad_norm": float(np.mean(clipped)),
                           "grad_norm/pre_clip": float(np.mean(norms)), "optim/steps": optim_steps,
                           "tokens": int(sums["tokens"] / lc.num_iterations),
                           "micro_batches": len(micro), "packing_efficiency": packing_efficiency(micro),
                           "processed_tokens": sum(mb.num_tokens for mb in micro) * lc.num_iterations,
                           "prompt_sharing/saved_tokens": shared_tokens(batch, micro)}
    seqs = max(sums["sequences"], 1.0)
    out |= {k: v / (seqs if k in PER_SEQUENCE else tokens) for k, v in sums.items()
            if k not in ("tokens", "sequences") and not k.startswith("_") and (k != "kl" or lc.beta)}
    lo, hi = reduce_values(ranks, {"v": clip["clip_ratio/low_min"]}, "min")["v"], \
        reduce_values(ranks, {"v": clip["clip_ratio/high_max"]}, "max")["v"]
    if np.isfinite(lo) and np.isfinite(hi):  # TRL's: the extreme micro-batch means, over all ranks
        out["clip_ratio/low_min"], out["clip_ratio/high_max"] = lo, hi
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


def resume(resume_step: int | None, run_dir: Path, p: Policy, merged_keys: list[str] | None, keep: int,
           cfg: TrainConfig | None = None) -> int:
    """Restore checkpoint `resume_step` (train `ckpt.resume_step`; -1: the newest; None: start fresh) into every
    rank and rewind the run directory, keeping `keep` policies (republished with their QeRL noise per `cfg`);
    returns the restored step (collective)."""
    from tidal.checkpoint import CheckpointError, resolve_resume_step
    from tidal.paths import ckpt_root
    from tidal.trainer.ckpt import COMPONENT, rewind_run_dir

    step = None
    if p.ranks.main:
        step = resolve_resume_step(run_dir, COMPONENT, resume_step)
        if step is None and resume_step is not None:
            if weights.stable_steps(run_dir) or metrics_path(run_dir).exists():
                raise CheckpointError(f"cannot resume: {run_dir} holds trained steps but no trainer checkpoint "
                                      f"under {ckpt_root(run_dir, COMPONENT)} (set train ckpt.interval to write "
                                      f"them)")
            log.info("resume requested but %s holds no trainer checkpoint and no trained step: starting fresh",
                     run_dir)
    step = broadcast_int(p.ranks, -1 if step is None else step)
    if step < 0:
        return 0
    restore(p, run_dir, step)
    noise = qerl_noise(cfg, step) if cfg is not None else None
    if p.ranks.main:
        assert p.view is not None
        rewind_run_dir(run_dir, step, p.view, merged_keys, keep=keep, noise=noise)
        log.info("resumed from checkpoint step %d (optimizer step %d, lr %.3g); next batch: %d", step,
                 optimizer_steps(p.opt), p.sched.get_last_lr()[0], step + 1)
    return step


def open_source(cfg: TrainConfig, run_dir: Path) -> BatchSource:
    """Where batches come from: `rollouts/` (filesystem) or the orchestrator's zmq server."""
    if cfg.transport_type == "zmq":
        from tidal.transport.zmq_transport import ZmqBatchReader

        return ZmqBatchReader(cfg.transport_host, cfg.transport_port)
    return BatchReader(run_dir)


class PeakWatch:
    """`memory/peak_gb` of every step (the largest over the ranks) and one warning when it passes the
    estimate the co-locate memory split was sized with (GPU only: on CPU the peak RSS also holds the
    libraries)."""

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        self.device = device
        self.estimate: float | None = None
        if device.type == "cuda":
            try:
                self.estimate = train_footprint_gib(cfg)
            except (OSError, ValueError, KeyError) as exc:
                log.info("no memory estimate for %s (%r)", cfg.model, exc)
        self.warned = False

    def start(self) -> None:
        reset_peak(self.device)

    def measure(self, ranks: Ranks) -> float:
        peak = reduce_values(ranks, {"peak": peak_gib(self.device)}, "max")["peak"]
        if self.estimate is not None and peak > self.estimate and not self.warned:
            self.warned = True
            log.warning("trainer peak memory %.2f GiB exceeds the estimate %.2f GiB that vLLM's share was sized "
                        "with; set infer gpu_memory_utilization lower if vLLM runs on the same GPU", peak,
                        self.estimate)
        return peak


def train_and_publish(step: int, batch: TrainingBatch, p: Policy, cfg: TrainConfig, run_dir: Path,
                      pusher: Pusher | None, merged_keys: list[str] | None, peak: PeakWatch,
                      prober: Prober | None = None) -> dict[str, Any]:
    """Trainer step `step` on `batch`, then push (nccl) and publish policy `step` (with its identity probe:
    `prober`), and checkpoint every `ckpt.interval` steps; returns the trainer's metrics with their timings (every
    rank runs it; rank 0 publishes)."""
    t0 = time.monotonic()
    peak.start()
    tm = train_step(p.model, p.opt, batch, cfg, p.device, p.pad_id, ranks=p.ranks, sched=p.sched,
                    reference=p.reference, entropy=p.entropy)
    lr = p.sched.get_last_lr()[0]
    p.sched.step()
    sync_view(p)
    tm["memory/peak_gb"] = peak.measure(p.ranks)
    train_time = time.monotonic() - t0
    push_time = probe_time = publish_time = 0.0
    noise = qerl_noise(cfg, step)
    if p.ranks.main:
        assert p.view is not None
        push_time = pusher.push_policy(p.view, run_dir, step) if pusher else 0.0
        t1 = time.monotonic()
        probe = prober.record(p.view, step) if prober is not None else None
        t2 = time.monotonic()
        probe_time = t2 - t1
        publish_adapter(p.view, run_dir, step, keep=cfg.max_async_level + 2, merged_keys=merged_keys, noise=noise,
                        probe=probe)
        publish_time = time.monotonic() - t2
    ckpt_time = 0.0
    if cfg.ckpt.interval and step % cfg.ckpt.interval == 0:
        t1 = time.monotonic()
        save(p, run_dir, step, cfg)
        ckpt_time = time.monotonic() - t1
    return {**tm, "lr": lr, "optimizer_steps": optimizer_steps(p.opt), "train_time_s": train_time,
            "broadcast_time_s": time.monotonic() - t0 - train_time - ckpt_time, "ckpt_time_s": ckpt_time,
            **({"push_time_s": push_time} if pusher else {}), "trainer_ranks": p.ranks.world,
            **({"probe_time_s": probe_time} if prober else {}), "timing/publish_s": publish_time,
            **({"qerl/sigma": noise[0] if noise else 0.0} if cfg.noise_scheduler.enabled else {}),
            "trainer_tokens_per_s": tm["processed_tokens"] / max(train_time, 1e-9)}


def finish(p: Policy, cfg: TrainConfig, run_dir: Path, step: int, resumed_from: int) -> None:
    """After the last step: a final checkpoint, the exports (`export.*`) and the run report (rank 0). A failed
    GGUF step (`GGUFExportError`, after everything else is written) is raised after the report: the run trained,
    and its exit code says what it lacks (`tidal.procs.EXPORT_FAILED`)."""
    from tidal.trainer.publish.export import GGUFExportError, export_final

    if cfg.ckpt.interval and step > resumed_from and step % cfg.ckpt.interval:
        save(p, run_dir, step, cfg)  # the last step too: a longer run resumes
    if not p.ranks.main:
        return
    log.info("trainer finished after %d steps; metrics in %s", step, metrics_path(run_dir))
    failed: GGUFExportError | None = None
    if step > 0:
        try:  # the GGUF last: its failure costs nothing else
            for what, path in export_final(p.view, p.tokenizer, cfg.export, cfg.model, run_dir,
                                           cfg.rope_scaling).items():
                log.info("final %s: %s", what, path)
        except GGUFExportError as exc:
            failed = exc
    try:
        from tidal.monitor.report import write_report

        log.info("run report: %s", write_report(run_dir))
    except Exception as exc:  # noqa: BLE001 - a failed report must not fail a finished run
        log.warning("could not write the run report: %r (retry with `tidal report %s`)", exc, run_dir)
    if failed is not None:
        raise failed


def next_batch(step: int, source: BatchSource | None, cfg: TrainConfig, p: Policy, run_dir: Path,
               pusher: Pusher | None) -> TrainingBatch | None:
    """Batch `step` (None: the run is over): rank 0 waits for it, then every rank gets it."""
    batch = None
    if p.ranks.main:
        assert source is not None
        on_tick = (functools.partial(pusher.serve_push_request, p.view, run_dir, step - 1)
                   if pusher and p.view is not None else None)
        batch = source.wait(step, cfg.batch_timeout_s, on_wait=functools.partial(_note_wait, step),
                            on_tick=on_tick)
        if batch is not None and batch.step != step:
            raise ValueError(f"batch {step} from {source.where} holds step {batch.step}")
    return broadcast_batch(p.ranks, batch)  # None too: then every rank leaves the loop


def shares_prompts(model: torch.nn.Module, cfg: TrainConfig, batch: TrainingBatch) -> bool:
    """Whether this step packs each prompt once (train `prompt_sharing`; `tidal.trainer.step.packing`)."""
    return (cfg.prompt_sharing is not False and not batch.has_images
            and prompt_sharing_blocker(model.config, cfg.sequence_len) is None)


def flat_rows(model: torch.nn.Module, batch: TrainingBatch) -> bool:
    """Whether this step packs each micro-batch as one row without padding (`tidal.trainer.step.packing`'s `flat`:
    the same update for fewer tokens; tidal's per-sample attention on text batches)."""
    return not batch.has_images and flat_rows_blocker(model.config, FLAT_MAX_TOKENS) is None


def slim_reloads(cfg: TrainConfig) -> bool:
    """Whether each policy's merged copy holds only the LoRA-adapted weights (`changed_keys`): LoRA on an unquantized
    base without QeRL (its noise is on the norms; a QLoRA base is served dequantized, every quantized layer)."""
    return cfg.lora and qlora_kind(cfg) is None and not cfg.noise_scheduler.enabled


def make_prober(p: Policy, cfg: TrainConfig, run_dir: Path, resumed_from: int) -> Prober | None:
    """Rank 0's identity probe (`tidal.trainer.publish.probe`), unless QeRL noise makes the served copy differ on
    purpose."""
    if not p.ranks.main or cfg.noise_scheduler.enabled:
        if p.ranks.main:
            log.info("no policy identity probe: QeRL's noise makes vLLM serve another copy on purpose")
        return None
    assert p.view is not None
    prober = Prober(p.view, p.tokenizer, p.reference, fresh=resumed_from == 0, context=cfg.sequence_len)
    if resumed_from:
        prober.resume_from(run_dir, resumed_from)
    return prober


def run(cfg: TrainConfig, run_dir: Path, ranks: Ranks = SINGLE) -> int:
    """Train until `max_steps` or the orchestrator's DONE; returns the number of steps trained. Every rank runs
    it (`tidal.trainer.distributed`)."""
    check_train(cfg)  # the refusals `tidal grpo` also runs before anything starts (`tidal.colocate.preflight`)
    total = cfg.max_steps if cfg.max_steps > 0 else None
    p = build_policy(cfg, total, ranks)
    # a fully fine-tuned policy is published as its merged (= all) weights
    merged_keys = checkpoint_keys(resolve_model(cfg.model)) if cfg.broadcast_merged or not cfg.lora else None
    if merged_keys is not None and p.view is not None and slim_reloads(cfg):
        merged_keys = changed_keys(p.view, merged_keys)  # each policy's merged copy: only what LoRA changes
    source = open_source(cfg, run_dir) if ranks.main else None
    step = resumed_from = resume(cfg.ckpt.resume_step, run_dir, p, merged_keys, keep=cfg.max_async_level + 2,
                                 cfg=cfg)
    prober = make_prober(p, cfg, run_dir, resumed_from)
    if ranks.main and qlora_kind(cfg) is not None:
        assert p.view is not None
        publish_base(p.view, cfg, run_dir, prober.record(p.view, 0) if prober and not resumed_from else None)
    pusher = make_pusher(cfg, p.device) if ranks.main else None
    metrics = MetricsWriter(metrics_path(run_dir)) if ranks.main else None
    log.info("trainer ready on %s%s: %s trainable parameters; waiting for batches in %s", p.device,
             f" (+{ranks.world - 1} more ranks, FSDP2 zero_level {cfg.zero_level})" if ranks.sharded else "",
             f"{sum(q.numel() for q in (p.view or p.model).parameters() if q.requires_grad):,}",
             source.where if source else "-")
    if ranks.main:  # the report's matplotlib, imported while this trainer waits for its first batch
        from tidal.monitor.report import preload

        preload()
    guard = MismatchGuard(cfg.mismatch_guard)
    peaks = PeakWatch(cfg, p.device)
    step_times: list[float] = []
    last_done: float | None = None  # the first step counts from its batch's arrival: a trainer started with vLLM
    # (tidal.colocate.start_order) waits for batch 1 through vLLM's start-up, which is `wait_time_s`, not step time
    while total is None or step < total:
        wait_start = time.monotonic()
        batch = next_batch(step + 1, source, cfg, p, run_dir, pusher)
        if batch is None:
            break
        step += 1
        waited = time.monotonic() - wait_start
        if "timing/handoff_at" in batch.metrics:  # the orchestrator's put -> here: write, poll, read
            batch.metrics["timing/handoff_s"] = time.time() - batch.metrics.pop("timing/handoff_at")
        record = {"step": step, **batch.metrics, "policy_step": batch.policy_step,
                  "off_policy_level": batch.off_policy_level, "max_steps": batch.max_steps,
                  "resumed_from": resumed_from, "wait_time_s": waited,
                  **train_and_publish(step, batch, p, cfg, run_dir, pusher, merged_keys, peaks, prober)}
        now = time.monotonic()
        record["step_time_s"], last_done = now - (wait_start + waited if last_done is None else last_done), now
        if metrics is None:
            continue
        metrics.write(record)
        if qerl_noise(cfg, batch.policy_step) is None:  # QeRL noise is a mismatch by design
            guard.check(step, record)  # reads the batch's typed off_policy_level, recorded above
        step_times.append(record["step_time_s"])
        if step % cfg.logging_steps == 0 or step == total:
            goal = total or batch.max_steps
            eta = (goal - step) * sum(step_times[-5:]) / len(step_times[-5:]) if goal else None
            log.info(progress_line(record, goal, eta))
    if pusher is not None:
        pusher.close()
    finish(p, cfg, run_dir, step, resumed_from)
    return step
