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

from tidal.checkpoint import CheckpointError, prune_checkpoints, resolve_resume_step, write_checkpoint
from tidal.config.orch import CkptSection
from tidal.monitor.metrics import truncate_metrics
from tidal.orchestrator.buffer import Buffer
from tidal.orchestrator.envmix import EnvMix
from tidal.paths import batch_path, ckpt_dir, ckpt_root, done_path, eval_path, rollouts_dir, samples_path, step_files

log = logging.getLogger("tidal.orch")
COMPONENT = "orch"


@dataclass
class Progress:
    """What the orchestrator has produced so far."""

    step: int = 0
    total_tokens: int = 0
    total_samples: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def save_orch(run_dir: Path, progress: Progress, rng: random.Random, ckpt: CkptSection,
              mix: EnvMix | None = None, buffer: Buffer | None = None) -> Path:
    """Checkpoint `progress.step` atomically; prune per `ckpt` (keep_last, keep_interval)."""
    state = {"progress": asdict(progress), "buffer": {"sampler_rng": _rng_to_json(rng.getstate()),
                                                      "env_mix": mix.state() if mix is not None else {},
                                                      "pools": buffer.state() if buffer is not None else {}}}

    def fill(tmp: Path) -> None:
        (tmp / "state.json").write_text(json.dumps(state))

    path = write_checkpoint(run_dir, COMPONENT, progress.step, fill)
    prune_checkpoints(run_dir, COMPONENT, ckpt.keep_last, ckpt.keep_interval)
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


def resume_orch(run_dir: Path, ckpt: CkptSection, rng: random.Random, mix: EnvMix | None = None,
                buffer: Buffer | None = None) -> Progress:
    """Restore per `ckpt` (a fresh Progress when not resuming) and rewind the run directory."""
    step = resolve_resume_step(run_dir, COMPONENT, ckpt.resume_step)
    batches = step_files(rollouts_dir(run_dir), ".safetensors")
    if step is None:
        if ckpt.resume_step is not None and batches:
            raise CheckpointError(f"cannot resume: {rollouts_dir(run_dir)} holds batches but there is no "
                                  f"orchestrator checkpoint under {ckpt_root(run_dir, COMPONENT)} (set orch "
                                  f"ckpt.interval to write them)")
        return Progress()
    state = load_orch(run_dir, step)
    progress = Progress(step=step)
    if not ckpt.skip_progress:
        progress = Progress(**state["progress"])
    if not ckpt.skip_buffer:
        rng.setstate(state["buffer"]["sampler_rng"])
        if mix is not None:
            mix.load_state(state["buffer"].get("env_mix", {}))
        if buffer is not None:
            buffer.load_state(state["buffer"].get("pools", {}))
    later = [s for s in batches if s > step]
    for s in later:
        batch_path(run_dir, s).unlink(missing_ok=True)
    removed = len(later)
    done_path(run_dir).unlink(missing_ok=True)
    truncate_metrics(samples_path(run_dir), step)
    truncate_metrics(eval_path(run_dir), step)
    log.info("resumed from checkpoint step %d (%d tokens, %d samples so far); %d later batch(es) will be "
             "sampled again", step, progress.total_tokens, progress.total_samples, removed)
    return progress
