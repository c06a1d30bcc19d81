"""ZeroMQ transport (`rollout_transport.type: zmq`, trainer `transport_type: zmq`): batches over TCP, no
shared filesystem needed for them.

The orchestrator binds a ROUTER socket at `host:port` and keeps the batches it produced in memory; the trainer
connects a DEALER socket and asks for batch n (a JSON request). The reply is the batch's safetensors bytes
(`TrainingBatch.to_bytes`, never pickle), "wait" when it is not produced yet, or "done" when the orchestrator
finished before n. A request for a batch not produced yet is held up to `HOLD_S` and answered the moment the
batch is put (or the run finishes): the trainer gets it without a poll interval's latency. A request for n
acknowledges every batch before n, which is then dropped; at most `hwm` unacknowledged batches are kept: the
orchestrator waits before producing more (backpressure). A trainer that gets no answer (orchestrator restarting)
reconnects and asks again, up to its `batch_timeout_s`.

Resume: batches live in the orchestrator's memory, so a trainer that resumes from step t needs an orchestrator
that produces t+1 again — resume the orchestrator from a checkpoint <= t (`ckpt.resume_step`). A request for a
batch that was dropped gets an error naming this.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from tidal.transport.batch import BatchFormatError, TrainingBatch
from tidal.transport.waiting import BatchWait

log = logging.getLogger("tidal.transport")

HOLD_S = 1.0
"""Seconds the orchestrator holds a request for a batch not produced yet before it answers "wait" (well under the
trainer's reply timeout, 5 s): a batch put meanwhile is sent at once."""


class ZmqBatchServer:
    """Orchestrator side: serve batches to the trainer."""

    def __init__(self, host: str, port: int, hwm: int) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://{host}:{port}")
        self.hwm = hwm
        self.batches: dict[int, bytes] = {}
        self.acked = 0  # the trainer asked for acked + 1: everything up to acked is consumed
        self.done: int | None = None
        self.first_held: int | None = None  # the first batch this orchestrator produced (after a resume: m + 1)
        self.where = f"tcp://{host}:{port}"
        self.held: dict[bytes, int] = {}  # trainer identity -> the step it asked for, not produced yet
        self._finishing: asyncio.Task[None] | None = None
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            ident, _, raw = await self.sock.recv_multipart()
            try:
                step = int(json.loads(raw)["step"])
            except (ValueError, KeyError, TypeError):
                await self.sock.send_multipart([ident, b"", b"error", b"bad request"])
                continue
            self.acked = max(self.acked, step - 1)
            for s in [s for s in self.batches if s < step]:
                del self.batches[s]
            if step in self.batches:
                await self.sock.send_multipart([ident, b"", b"batch", self.batches[step]])
            elif self.done is not None and step > self.done:
                await self.sock.send_multipart([ident, b"", b"done", str(self.done).encode()])
            elif self.first_held is not None and step < self.first_held:
                msg = (f"batch {step} is no longer held by the orchestrator (zmq keeps batches in memory); resume "
                       f"the orchestrator from a checkpoint at or before step {step - 1}")
                await self.sock.send_multipart([ident, b"", b"error", msg.encode()])
            else:  # held: answered by `put` / `finish`, or "wait" after HOLD_S
                self.held[ident] = step
                asyncio.get_running_loop().call_later(HOLD_S, self._release, ident, step)

    def _release(self, ident: bytes, step: int) -> None:
        if self.held.get(ident) == step and not self.sock.closed:
            del self.held[ident]
            asyncio.ensure_future(self.sock.send_multipart([ident, b"", b"wait", b""]))

    async def _answer_held(self) -> None:
        for ident, step in list(self.held.items()):
            if step in self.batches:
                del self.held[ident]
                await self.sock.send_multipart([ident, b"", b"batch", self.batches[step]])
            elif self.done is not None and step > self.done:
                del self.held[ident]
                await self.sock.send_multipart([ident, b"", b"done", str(self.done).encode()])

    async def put(self, batch: TrainingBatch) -> None:
        """Hold `batch` for the trainer, first waiting while `hwm` batches are unacknowledged."""
        if self.first_held is None:
            self.first_held = batch.step
        while len([s for s in self.batches if s > self.acked]) >= self.hwm:
            await asyncio.sleep(0.05)
        self.batches[batch.step] = batch.to_bytes()
        await self._answer_held()

    def finish(self, last_step: int) -> None:
        self.done = last_step
        self._finishing = asyncio.get_running_loop().create_task(self._answer_held())

    async def close(self, linger_s: float = 5.0) -> None:
        """Keep answering for up to `linger_s` (so the trainer hears "done"), then close."""
        deadline = time.monotonic() + linger_s
        while self.done is not None and self.acked < self.done and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        self._task.cancel()
        self.sock.close()
        self.ctx.term()


class ZmqBatchReader:
    """Trainer side: ask the orchestrator for batch n."""

    def __init__(self, host: str, port: int, reply_timeout_s: float = 5.0) -> None:
        self.endpoint = f"tcp://{host}:{port}"
        self.where = self.endpoint
        self.ctx: Any = zmq.Context.instance()
        self.reply_timeout_s = reply_timeout_s
        self.sock: Any = None
        self._connect()

    def _connect(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.endpoint)

    def wait(self, step: int, timeout_s: float, poll_s: float = 0.05,
             on_wait: Callable[[float], None] | None = None,
             on_tick: Callable[[], None] | None = None) -> TrainingBatch | None:
        """Batch `step`, or None when the orchestrator finished before it. TimeoutError after `timeout_s`."""
        clock = BatchWait(step, self.endpoint, timeout_s, on_wait, on_tick=on_tick)
        while True:
            clock.tick()
            self.sock.send_multipart([b"", json.dumps({"step": step}).encode()])
            if not self.sock.poll(int(self.reply_timeout_s * 1000)):
                self._connect()  # no answer: the orchestrator is gone or restarting; ask again on a new socket
                continue
            _, kind, payload = self.sock.recv_multipart()
            if kind == b"batch":
                try:
                    return TrainingBatch.from_bytes(payload)
                except BatchFormatError as exc:
                    raise BatchFormatError(f"batch {step} from {self.endpoint}: {exc}") from exc
            if kind == b"done":
                return None
            if kind == b"error":
                raise RuntimeError(f"{self.endpoint}: {payload.decode(errors='replace')}")
            time.sleep(poll_s)
