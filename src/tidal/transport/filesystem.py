"""Filesystem transport: `{run_dir}/rollouts/step_{n}.safetensors`, written as temp file + rename.

A batch file exists only once complete (rename is atomic on one filesystem). When the orchestrator has
written its last batch it writes `rollouts/DONE` holding that step number, so a trainer with no
`max_steps` of its own knows when to stop.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from tidal.transport.batch import TrainingBatch
from tidal.transport.waiting import BatchWait


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temp file in the same directory and an atomic rename."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class BatchWriter:
    """Orchestrator side: publish batches and the final DONE marker."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / "rollouts"
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, step: int) -> Path:
        return self.dir / f"step_{step}.safetensors"

    def write(self, batch: TrainingBatch) -> Path:
        final = self.path(batch.step)
        tmp = final.with_name(f".{final.name}.tmp.{os.getpid()}")
        try:
            batch.save(tmp)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)  # never a half-written batch (e.g. disk full)
            raise
        return final

    async def put(self, batch: TrainingBatch) -> None:
        self.write(batch)

    def finish(self, last_step: int) -> None:
        atomic_write_bytes(self.dir / "DONE", str(last_step).encode())

    async def close(self) -> None:
        return None


class BatchReader:
    """Trainer side: wait for batch n (or for the orchestrator's DONE marker)."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / "rollouts"

    def done_step(self) -> int | None:
        """Last step the orchestrator will produce, once it has said so."""
        try:
            return int((self.dir / "DONE").read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def wait(self, step: int, timeout_s: float, poll_s: float = 0.05,
             on_wait: Callable[[float], None] | None = None,
             on_tick: Callable[[], None] | None = None) -> TrainingBatch | None:
        """Batch `step`, or None when the orchestrator finished before it. TimeoutError after `timeout_s`."""
        path = self.dir / f"step_{step}.safetensors"
        clock = BatchWait(step, str(path), timeout_s, on_wait, on_tick=on_tick)
        while True:
            if path.exists():
                return TrainingBatch.load(path)
            done = self.done_step()
            if done is not None and done < step:
                return None
            clock.tick()
            time.sleep(poll_s)
