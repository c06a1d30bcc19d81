"""Orchestrator checkpoints (`checkpoints/orch/step_n/state.json`) and resume.

Checkpoint n is written right after batch n: the progress (`step`, total tokens and samples) and the buffer
(the example sampler's RNG state, the environment mix's counters, the difficulty pools), as JSON. Resuming
from n rolls the run directory back to n: batches of later steps and the `DONE` marker are removed (they are
produced again, from the restored sampler), and `samples.jsonl` keeps only steps <= n. The step is always
restored — it must match the trainer's; `skip_progress` / `skip_buffer` leave the counters / the sampler
and pools fresh.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tidal.checkpoint import (
    CheckpointError,
    ckpt_dir,
    prune_checkpoints,
    resolve_resume_step,
    write_checkpoint,
)
from tidal.config.orch import OrchConfig
from tidal.monitor.metrics import truncate_metrics
from tidal.orchestrator.buffer import Buffer
from tidal.orchestrator.envmix import EnvMix

log = logging.getLogger("tidal.orch")
COMPONENT = "orch"


@dataclass
class Progress:
    """What the orchestrator has produced so far."""

    step: int = 0
    total_tokens: int = 0
    total_samples: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def save_orch(run_dir: Path, progress: Progress, rng: random.Random, cfg: OrchConfig,
              mix: EnvMix | None = None, buffer: Buffer | None = None) -> Path:
    """Checkpoint `progress.step` atomically; prune per `cfg.ckpt`."""
    state = {"progress": asdict(progress), "buffer": {"sampler_rng": _rng_to_json(rng.getstate()),
                                                      "env_mix": mix.state() if mix is not None else {},
                                                      "pools": buffer.state() if buffer is not None else {}}}

    def fill(tmp: Path) -> None:
        (tmp / "state.json").write_text(json.dumps(state))

    path = write_checkpoint(run_dir, COMPONENT, progress.step, fill)
    prune_checkpoints(run_dir, COMPONENT, cfg.ckpt.keep_last, cfg.ckpt.keep_interval)
    return path


def _rng_to_json(state: Any) -> Any:
    return [state[0], list(state[1]), state[2]]


def load_orch(run_dir: Path, step: int) -> dict[str, Any]:
    path = ckpt_dir(run_dir, COMPONENT, step) / "state.json"
    try:
        state = json.loads(path.read_text())
        state["progress"]["step"] = int(state["progress"]["step"])
        rng = state["buffer"]["sampler_rng"]
        state["buffer"]["sampler_rng"] = (int(rng[0]), tuple(int(x) for x in rng[1]), rng[2])
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {exc!r}") from exc
    if state["progress"]["step"] != step:
        raise CheckpointError(f"{path} holds step {state['progress']['step']}, expected {step}")
    return state


def resume_orch(run_dir: Path, cfg: OrchConfig, rng: random.Random, mix: EnvMix | None = None,
                buffer: Buffer | None = None) -> Progress:
    """Restore per `cfg.ckpt` (a fresh Progress when not resuming) and rewind the run directory."""
    step = resolve_resume_step(run_dir, COMPONENT, cfg.ckpt.resume_step)
    rollouts = run_dir / "rollouts"
    if step is None:
        if cfg.ckpt.resume_step is not None and any(rollouts.glob("step_*.safetensors")):
            raise CheckpointError(f"cannot resume: {rollouts} holds batches but there is no orchestrator "
                                  f"checkpoint under {run_dir / 'checkpoints' / COMPONENT} (set orch "
                                  f"ckpt.interval to write them)")
        return Progress()
    state = load_orch(run_dir, step)
    progress = Progress(step=step)
    if not cfg.ckpt.skip_progress:
        progress = Progress(**state["progress"])
    if not cfg.ckpt.skip_buffer:
        rng.setstate(state["buffer"]["sampler_rng"])
        if mix is not None:
            mix.load_state(state["buffer"].get("env_mix", {}))
        if buffer is not None:
            buffer.load_state(state["buffer"].get("pools", {}))
    removed = 0
    for f in list(rollouts.glob("step_*.safetensors")):
        if f.stem[5:].isdigit() and int(f.stem[5:]) > step:
            f.unlink(missing_ok=True)
            removed += 1
    (rollouts / "DONE").unlink(missing_ok=True)
    truncate_metrics(run_dir / "samples.jsonl", step)
    truncate_metrics(run_dir / "eval.jsonl", step)
    log.info("resumed from checkpoint step %d (%d tokens, %d samples so far); %d later batch(es) will be "
             "sampled again", step, progress.total_tokens, progress.total_samples, removed)
    return progress
