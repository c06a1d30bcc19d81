"""Filesystem transport: `{run_dir}/rollouts/step_{n}.safetensors`, each written atomically
(`tidal.paths.atomic_file`: temp name, fsync, rename).

A batch file exists only once complete. When the orchestrator has written its last batch it writes
`rollouts/DONE` holding that step number, so a trainer with no `max_steps` of its own knows when to stop.

The trainer looks for its batch every `POLL_S` (one `stat`): the hand-over's latency is half of that on average
(it was 50 ms: ~25 ms a step on the critical path when training on-policy); `DONE`, needed once a run, is read
at most every `DONE_EVERY_S`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from tidal.paths import atomic_file, batch_path, done_path, rollouts_dir, write_atomic
from tidal.transport.batch import TrainingBatch
from tidal.transport.waiting import BatchWait

POLL_S = 0.005
"""Seconds between two looks for the awaited batch file (a `stat` each: ~200 a second while the trainer waits)."""
DONE_EVERY_S = 0.25
"""Seconds between two reads of `rollouts/DONE` while waiting (it only ends a run: no need to read it per poll)."""


class BatchWriter:
    """Orchestrator side (`BatchSink`): publish batches and the final DONE marker."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.where = str(rollouts_dir(run_dir))
        rollouts_dir(run_dir).mkdir(parents=True, exist_ok=True)

    def write(self, batch: TrainingBatch) -> Path:
        final = batch_path(self.run_dir, batch.step)
        with atomic_file(final) as tmp:  # never a half-written batch (e.g. disk full)
            batch.save(tmp)
        return final

    async def put(self, batch: TrainingBatch) -> None:
        self.write(batch)

    def finish(self, last_step: int) -> None:
        write_atomic(done_path(self.run_dir), str(last_step))

    async def close(self) -> None:
        return None


class BatchReader:
    """Trainer side (`BatchSource`): wait for batch n (or for the orchestrator's DONE marker)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.where = str(rollouts_dir(run_dir))

    def done_step(self) -> int | None:
        """Last step the orchestrator will produce, once it has said so."""
        try:
            return int(done_path(self.run_dir).read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def wait(self, step: int, timeout_s: float, poll_s: float = POLL_S,
             on_wait: Callable[[float], None] | None = None,
             on_tick: Callable[[], None] | None = None) -> TrainingBatch | None:
        """Batch `step`, or None when the orchestrator finished before it. TimeoutError after `timeout_s`."""
        path = batch_path(self.run_dir, step)
        clock = BatchWait(step, str(path), timeout_s, on_wait, on_tick=on_tick)
        done_read = -DONE_EVERY_S
        while True:
            if path.exists():
                return TrainingBatch.load(path)
            if (now := time.monotonic()) - done_read >= DONE_EVERY_S:
                done, done_read = self.done_step(), now
                if done is not None and done < step:
                    return None
            clock.tick()
            time.sleep(poll_s)
