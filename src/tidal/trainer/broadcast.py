"""Publish the policy after step n: `{run_dir}/broadcasts/step_{n}/` (PEFT adapter) plus a `STABLE` marker.

The adapter is saved into a temp directory that is renamed into place, then `STABLE` is written: a reader
that sees `STABLE` sees a complete adapter. Older broadcasts beyond `keep` are removed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any


def broadcast_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "broadcasts" / f"step_{step}"


def publish_adapter(model: Any, run_dir: Path, step: int, keep: int | None = None) -> Path:
    """Save `model`'s adapter for `step` atomically; prune all but the newest `keep` broadcasts."""
    final = broadcast_dir(run_dir, step)
    tmp = final.with_name(f".{final.name}.tmp.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(final, ignore_errors=True)
    model.save_pretrained(str(tmp))  # adapter_config.json + adapter_model.safetensors
    os.replace(tmp, final)
    (final / ".STABLE.tmp").write_text(str(step))
    os.replace(final / ".STABLE.tmp", final / "STABLE")
    if keep is not None:
        prune(run_dir, keep)
    return final


def stable_steps(run_dir: Path) -> list[int]:
    """Steps with a complete broadcast, ascending."""
    root = run_dir / "broadcasts"
    steps = []
    for d in root.glob("step_*") if root.is_dir() else []:
        if (d / "STABLE").exists() and d.name[5:].isdigit():
            steps.append(int(d.name[5:]))
    return sorted(steps)


def prune(run_dir: Path, keep: int) -> None:
    for step in stable_steps(run_dir)[:-keep]:
        shutil.rmtree(broadcast_dir(run_dir, step), ignore_errors=True)
