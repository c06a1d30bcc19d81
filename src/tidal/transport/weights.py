"""The weight-sync protocol between trainer and orchestrator: how policy n gets from one to the other.

Torch-free, imported by both sides (as `transport.batch` is for batches):
- **Publication** (trainer): after step n the trainer fills `broadcasts/step_n/` (the PEFT adapter, and with
  merged reloads `merged/model.safetensors`) through `publish`, which writes it atomically and marks it
  `STABLE` (`tidal.paths.atomic_dir`), then prunes all but the newest `keep` policies. With
  `weight_broadcast.type: nccl` the trainer pushes the weights into vLLM first and publishes after, so a
  `STABLE` policy n is one every server already serves.
- **Discovery** (orchestrator): `stable_steps` / `newest_policy` list complete policies; `policy_stamp`
  identifies one publication (a policy that a resumed trainer published again has a new stamp and is loaded
  again); `check_adapter` refuses an adapter whose LoRA shape differs from what the orchestrator was told.
- **Re-push requests** (nccl): an orchestrator that finds a server behind (it restarted) writes
  `broadcasts/PUSH_REQUEST` with the step it needs (`request_push`); the trainer serves it while waiting
  for its next batch (`push_requested`, `clear_push_request`).
- **Policy 0** is the model the server loaded, unless the trainer publishes `broadcasts/step_0/merged` (its
  quantized QLoRA base, dequantized): then the orchestrator reloads it before any rollout or adapter, and
  pruning keeps it.
- **Rewind** (trainer resume at n): `drop_after(n)` removes the policies of steps that are trained again.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from tidal.paths import STABLE, atomic_dir, broadcast_dir, broadcasts_dir, push_request_path, write_atomic
from tidal.paths import stable_steps as _stable_steps


def stable_steps(run_dir: Path) -> list[int]:
    """Steps with a complete (STABLE) policy, ascending."""
    return _stable_steps(broadcasts_dir(run_dir))


def newest_policy(run_dir: Path) -> int:
    """The newest complete policy; 0 (the base model) when none is published."""
    steps = stable_steps(run_dir)
    return steps[-1] if steps else 0


def policy_stamp(run_dir: Path, step: int) -> int:
    """Identifies one publication of policy `step` (its STABLE marker's mtime); 0 when it is gone."""
    try:
        return (broadcast_dir(run_dir, step) / STABLE).stat().st_mtime_ns
    except FileNotFoundError:
        return 0


def merged_dir(run_dir: Path, step: int) -> Path:
    """Where policy `step`'s merged full weights are (`train.broadcast_merged`)."""
    return broadcast_dir(run_dir, step) / "merged"


def publish(run_dir: Path, step: int, fill: Callable[[Path], None], keep: int | None = None) -> Path:
    """Publish policy `step`: `fill(tmp_dir)` writes its files, then rename + STABLE; prune all but the newest
    `keep` policies. A failed write leaves no partial policy."""
    final = broadcast_dir(run_dir, step)
    with atomic_dir(final, marker=str(step)) as tmp:
        fill(tmp)
    if keep is not None:
        prune(run_dir, keep)
    return final


def prune(run_dir: Path, keep: int) -> None:
    """Remove all complete policies but the newest `keep`, and policy 0 (published only for a quantized base,
    which a restarted server must load again before any adapter)."""
    for step in [s for s in stable_steps(run_dir) if s > 0][:-keep]:
        shutil.rmtree(broadcast_dir(run_dir, step), ignore_errors=True)


def drop_after(run_dir: Path, step: int) -> list[int]:
    """Remove the policies of steps after `step` (a resumed trainer trains them again); returns them."""
    later = [s for s in stable_steps(run_dir) if s > step]
    for s in later:
        shutil.rmtree(broadcast_dir(run_dir, s), ignore_errors=True)
    return later


def request_push(run_dir: Path, step: int, reason: str) -> None:
    """Orchestrator: ask the trainer to push its current policy (at least `step`) again."""
    write_atomic(push_request_path(run_dir), json.dumps({"step": step, "reason": reason}))


def push_requested(run_dir: Path) -> int | None:
    """Trainer: the step an orchestrator asked to have pushed again, if any."""
    try:
        return int(json.loads(push_request_path(run_dir).read_text())["step"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def clear_push_request(run_dir: Path) -> None:
    push_request_path(run_dir).unlink(missing_ok=True)


def check_adapter(path: Path, rank: int | None, alpha: float | None) -> None:
    """Refuse a published adapter whose rank or alpha differs from orch `model.lora_rank` / `lora_alpha` (when
    set): a trainer started with other LoRA settings than the ones this run was configured for."""
    if rank is None and alpha is None:
        return
    cfg_path = path / "adapter_config.json"
    got = json.loads(cfg_path.read_text())
    for key, want, have in (("lora_rank", rank, got.get("r")), ("lora_alpha", alpha, got.get("lora_alpha"))):
        if want is not None and have is not None and float(have) != float(want):
            raise ValueError(f"{cfg_path} has {key.split('_')[1]} {have} but orch model.{key} is {want}: the trainer "
                             f"runs with other LoRA settings than this orchestrator expects (fix one of them)")
