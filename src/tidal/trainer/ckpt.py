"""Trainer checkpoints (`checkpoints/trainer/step_n/`) and exact resume.

A checkpoint holds everything step n+1 depends on: the LoRA adapter (`adapter/`, a PEFT directory that
`PeftModel.from_pretrained` also loads; full fine-tuning: every weight, `model/`), the optimizer state keyed
by parameter name (full tensors, whatever the number of trainer ranks that wrote it: `tidal.trainer.distributed`
gathers them on rank 0, so a run resumes with any number of ranks), the LR scheduler's state, the RNG states of
Python, NumPy and torch (CPU and CUDA; torch's of every rank), and the step (`trainer_state.json` +
`.safetensors`, see `tidal.checkpoint`).
Resuming from step n also rolls the run directory back to step n: broadcasts of later steps (policies
of a future that is being retrained) are removed, broadcast n is published again, and `metrics.jsonl`
keeps only steps <= n, so the next step writes n+1 and no step appears twice.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tidal.checkpoint import TRAINER, CheckpointError, prune_checkpoints, write_checkpoint
from tidal.config.train import TrainCkptSection
from tidal.paths import ckpt_dir, metrics_path
from tidal.trainer.state import load_state, save_state
from tidal.transport import weights

log = logging.getLogger("tidal.trainer")
COMPONENT = TRAINER
REFERENCE = "reference"
"""A checkpoint's folder of the KL reference's weights (only with `loss.sync_ref_model`, where it moves)."""


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_trainer(run_dir: Path, step: int, model: Any, optimizer: dict[str, Any],
                 sched: torch.optim.lr_scheduler.LRScheduler, ckpt: TrainCkptSection,
                 rank_rngs: list[torch.Tensor] | None = None, entropy: dict[str, Any] | None = None,
                 reference: Any = None) -> Path:
    """Write checkpoint `step` atomically and prune old ones per `ckpt` (keep_last, keep_interval). `model`: the
    (unsharded) policy; `optimizer`: its name-keyed state (`distributed.optimizer_state`); `rank_rngs`: every
    rank's torch RNG state (`distributed.rng_states`); `entropy`: the adaptive entropy coefficient's state
    (`EntropyControl.state`); `reference`: the KL reference when it changes during the run (`loss.sync_ref_model`),
    saved beside the policy (`reference/`)."""
    from tidal.trainer.publish.broadcast import is_peft

    def fill(tmp: Path) -> None:
        # the adapter (LoRA), or every weight (full fine-tuning: a Hugging Face model directory)
        model.save_pretrained(str(tmp / ("adapter" if is_peft(model) else "model")))
        if reference is not None:
            reference.save_pretrained(str(tmp / REFERENCE))
        save_state(tmp, "trainer_state", {"step": step, "optimizer": optimizer, "optimizer_format": "by_name",
                                          "scheduler": sched.state_dict(), "rng": rng_state(),
                                          "rank_rngs": list(rank_rngs or []), "entropy_control": entropy})

    path = write_checkpoint(run_dir, COMPONENT, step, fill)
    prune_checkpoints(run_dir, COMPONENT, ckpt.keep_last, ckpt.keep_interval)
    return path


def by_name(model: Any, optimizer: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter index (torch's `state_dict()`, checkpoints before multi-rank
    training) keyed by parameter name instead: index i is the i-th trainable parameter of `model`."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if len(names) < sum(len(g["params"]) for g in optimizer["param_groups"]):
        raise CheckpointError("the checkpoint's optimizer state has more parameters than this model trains")
    return {"state": {names[int(i)]: s for i, s in optimizer["state"].items()},
            "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in optimizer["param_groups"]]}


def load_full_weights(model: Any, directory: Path) -> None:
    """A fully fine-tuned checkpoint's weights (`save_pretrained` files) into `model`; tied weights, which
    `save_pretrained` stores once, are the only keys allowed to be absent."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} holds no weights (a LoRA checkpoint? train lora must match the run)")
    state: dict[str, Any] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"checkpoint file {f} is corrupt: {exc}") from exc
    result = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"{directory} does not match this model (missing {missing[:3]}, unexpected "
                              f"{result.unexpected_keys[:3]})")


def load_trainer(run_dir: Path, step: int, model: Any,
                 sched: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    """Restore the adapter into `model` (the unsharded policy), the scheduler and the RNG states from checkpoint
    `step`; returns {"optimizer": name-keyed state, "rank_rngs": [...], "entropy_control": state or None} for
    `tidal.trainer.distributed` to give every rank its part."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from tidal.trainer.publish.broadcast import is_peft

    d = ckpt_dir(run_dir, COMPONENT, step)
    state = load_state(d, "trainer_state")
    if state.get("step") != step:
        raise CheckpointError(f"{d / 'trainer_state.json'} holds step {state.get('step')}, expected {step}")
    if is_peft(model):
        weights = d / "adapter" / "adapter_model.safetensors"
        try:
            adapter = load_file(str(weights))
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"checkpoint file {weights} is missing or corrupt: {exc}") from exc
        result = set_peft_model_state_dict(model, adapter)
        missing = [k for k in getattr(result, "unexpected_keys", [])]
        if missing:
            raise CheckpointError(f"{weights} does not match this model's LoRA layout (unexpected {missing[:3]}); "
                                  "was it written with other lora_rank / lora_target_modules?")
    else:
        load_full_weights(model, d / "model")
    try:
        sched.load_state_dict(state["scheduler"])
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{d / 'trainer_state.json'}: scheduler state does not fit ({exc})") from exc
    set_rng_state(state["rng"])
    optimizer = state["optimizer"]
    if state.get("optimizer_format") != "by_name":
        optimizer = by_name(model, optimizer)
    return {"optimizer": optimizer, "rank_rngs": state.get("rank_rngs") or [],
            "entropy_control": state.get("entropy_control")}


def rewind_run_dir(run_dir: Path, step: int, model: Any, merged_keys: list[str] | None, keep: int,
                   noise: tuple[float, int] | None = None) -> None:
    """After resuming at `step`: drop later broadcasts, publish broadcast `step` again, cut metrics.jsonl."""
    from tidal.monitor.metrics import truncate_metrics
    from tidal.trainer.publish.broadcast import publish_adapter

    weights.drop_after(run_dir, step)
    if step > 0:
        publish_adapter(model, run_dir, step, keep=keep, merged_keys=merged_keys, noise=noise)
    dropped = truncate_metrics(metrics_path(run_dir), step)
    if dropped:
        log.info("metrics.jsonl: removed %d record(s) of steps after %d (they are trained again)", dropped, step)
