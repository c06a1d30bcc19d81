"""The trainer's wait for a batch, shared by both transports: a status note every 30 s and a clear timeout."""

from __future__ import annotations

import time
from collections.abc import Callable


class BatchWait:
    """Call `tick()` once per poll; it reports the wait through `on_wait` and raises TimeoutError at the end.
    `on_tick` runs on every poll (the trainer serves weight re-push requests while it waits)."""

    def __init__(self, step: int, source: str, timeout_s: float,
                 on_wait: Callable[[float], None] | None = None, note_every_s: float = 30.0,
                 on_tick: Callable[[], None] | None = None) -> None:
        self.step, self.source, self.timeout_s, self.on_wait = step, source, timeout_s, on_wait
        self.on_tick = on_tick
        self.note_every_s = note_every_s
        self.start = self.last_note = time.monotonic()

    def tick(self) -> None:
        if self.on_tick is not None:
            self.on_tick()
        now = time.monotonic()
        if now - self.start > self.timeout_s:
            raise TimeoutError(f"no batch {self.step} from the orchestrator at {self.source} after "
                               f"{self.timeout_s:.0f} s (batch_timeout_s); is the orchestrator running? Restart it "
                               f"with --resume, then this trainer with --resume")
        if self.on_wait is not None and now - self.last_note >= self.note_every_s:
            self.on_wait(now - self.start)
            self.last_note = now
