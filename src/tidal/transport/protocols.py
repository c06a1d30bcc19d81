"""The two ends of the batch transport, as the orchestrator and the trainer see them.

`BatchSink` (orchestrator): `put` batch n (may wait: backpressure), `finish` after the last one, `close`.
`BatchSource` (trainer): `wait` for batch n — the batch, None when the orchestrator finished before n, or
TimeoutError. Implementations: `filesystem` (`rollouts/step_n.safetensors`, `rollouts/DONE`) and
`zmq_transport` (TCP, batches held in the orchestrator's memory).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tidal.transport.batch import TrainingBatch


class BatchSink(Protocol):
    """Orchestrator side."""

    where: str
    """Where batches go, for messages (a directory or a tcp:// endpoint)."""

    async def put(self, batch: TrainingBatch) -> None: ...

    def finish(self, last_step: int) -> None: ...

    async def close(self) -> None: ...


class BatchSource(Protocol):
    """Trainer side."""

    where: str
    """Where batches come from, for messages."""

    def wait(self, step: int, timeout_s: float, poll_s: float = 0.005,
             on_wait: Callable[[float], None] | None = None,
             on_tick: Callable[[], None] | None = None) -> TrainingBatch | None: ...
