"""The trainer's half of the policy identity check (`tidal.transport.probe`): the probe logprobs published with
each policy.

`Prober` scores the fixed probe sequence (`probe_ids`, `PROBE_LEN` tokens: one short forward, no grad) with the
base model once (LoRA: adapters disabled; full fine-tuning: the frozen reference, or the model before its first
step) and with each published policy, and hands `publish_adapter` a `ProbeRecord` holding the new policy's, the
previously published one's and the base's logprobs, which it writes inside the policy's directory before its
`STABLE`. Untempered logprobs through the trainer's own forward (what vLLM's prompt logprobs report), in its weights'
dtype: under train `recipe: bf16` on CPU (float32 weights, bf16 autocast) the probe is scored without the autocast,
so the record holds the policy the weights define, not one bf16 rounding of it (whose own noise, ~0.03 a token on
SmolLM2, is as large as a step's move and blurs the projection `judge` makes: bench/PROBE-68.md). Not
written for QeRL policies (their served copy carries noise on purpose: `tidal.trainer.model.noise`). The Tinker
service publishes its sampler checkpoints' probes with the same `score`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from tidal.transport.probe import ProbeRecord, probe_ids, probe_length

log = logging.getLogger("tidal.trainer")


def compute_dtype(model: torch.nn.Module) -> str:
    """The dtype the model's forward computes in (`TOLERANCE`'s key: `float32`, ...; the sampler `tidal grpo` pairs
    with it serves in it): its autocast dtype where it has one (train `recipe: bf16` on CPU: float32 weights,
    bfloat16 matmuls), else its input embedding's. (`score` itself scores the probe without the autocast.)"""
    from tidal.trainer.model.precision import autocast_dtype

    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None  # type: ignore[operator]
    dtype = autocast_dtype(model) or (emb.weight.dtype if emb is not None else next(model.parameters()).dtype)
    return str(dtype).removeprefix("torch.")


def vocab_limit(model: torch.nn.Module, tokenizer: Any) -> int:
    """Token ids the probe may use: below both the tokenizer's size (what vLLM accepts) and the model's rows."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None  # type: ignore[operator]
    rows = out.weight.shape[0] if out is not None else None
    sizes = [int(n) for n in (len(tokenizer) if tokenizer is not None else None, rows) if n]
    return min(sizes)


@torch.no_grad()
def score(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """Untempered logprob of each of `ids` given the ones before it (the first: 0), float32, through the trainer's
    own forward (`forward_logprobs`: its attention and chunked head) in the weights' dtype (no autocast)."""
    from tidal.trainer.model import router_replay
    from tidal.trainer.model.precision import without_autocast
    from tidal.trainer.step.logprobs import forward_logprobs

    router_replay.use(model, None)  # the routers choose, as vLLM's do for a plain prompt
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)  # (1, T)
    training = model.training
    model.eval()  # no dropout (train lora_dropout)
    try:
        with without_autocast(model):
            lp = forward_logprobs(model, x, torch.arange(len(ids), device=device)[None], 1.0)[0]  # (T,)
    finally:
        model.train(training)
    return [0.0, *lp[1:].float().cpu().tolist()]


class Prober:
    """The probe records of one trainer run (rank 0); `context`: train `sequence_len`, which bounds the probe's length
    (a sampler holding fewer tokens is sent the probe's first ones: `tidal.orchestrator.identity.check_served`)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, reference: torch.nn.Module | None = None,
                 fresh: bool = True, context: int | None = None) -> None:
        self.dtype = compute_dtype(model)
        self.ids = probe_ids(vocab_limit(model, tokenizer), probe_length(context, self.dtype))
        self.base = self._base(model, reference, fresh)
        self.previous: list[float] | None = self.base
        self.previous_step: int | None = 0 if self.base is not None else None

    def _base(self, model: torch.nn.Module, reference: torch.nn.Module | None, fresh: bool) -> list[float] | None:
        if hasattr(model, "disable_adapter"):  # LoRA: the base is the model with its adapters off
            with model.disable_adapter():  # type: ignore[operator]
                return score(model, self.ids)
        if reference is not None:
            return score(reference, self.ids)
        return score(model, self.ids) if fresh else None  # full fine-tuning before its first step

    def resume_from(self, run_dir: Path, step: int) -> None:
        """After a resume at `step`: the previous policy is the one published at `step` (when its probe is there)."""
        from tidal.paths import broadcast_dir

        rec = ProbeRecord.read(broadcast_dir(run_dir, step))
        if rec is not None and rec.ids == self.ids:
            self.previous, self.previous_step = rec.new, step

    def record(self, model: torch.nn.Module, step: int) -> ProbeRecord:
        """Policy `step`'s record (and it becomes the previous policy of the next)."""
        new = score(model, self.ids)
        rec = ProbeRecord(step=step, ids=self.ids, new=new, dtype=self.dtype, previous=self.previous,
                          previous_step=self.previous_step, base=self.base)
        self.previous, self.previous_step = new, step
        return rec

