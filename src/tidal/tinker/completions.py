"""Completion queues of sampling sessions: what `/api/v1/retrieve_futures` answers (Tinker 0.38's
`sample_use_retrieve_futures`), and the client ids `/api/v1/join_sampling_session` hands out.

With that option on, the SDK runs one poller per (sampling session, clone) instead of one `retrieve_future` long
poll per sample (`tinker.lib.session_futures_poller`): it long-polls `retrieve_futures` with the cursor of its last
answer, learns which of its requests finished or failed, and only then fetches each payload with `retrieve_future`;
the ids whose payloads it has fetched ride along on its next poll (`retrieved_request_ids`). A clone is named by its
`cloned_sampler_id`, `seq_id // 1_000_000_000` of its requests (0: the client that created the session; the SDK
gives each unpickled client its own block of seq_ids, and with `sample_join_sampling_session` asks the server for
the block: `Joins`).

One `CompletionQueue` per target holds that target's completions in the order they finished, each numbered by a
cursor that only grows (one sequence for the whole server). A poll first drops what its `prev_cursor` has seen
(events at or before it), then answers at once with every completion after it, or waits up to its `timeout` (none
given: `LONG_POLL_S`; 0: no wait) for the next one, and answers with the newest cursor. A lost answer costs
nothing: the SDK polls again with the old cursor and gets the same completions. The queue is bounded (`MAX_KEPT`: a
client that stops polling loses its oldest completions, with a warning, instead of growing the server); an idle one
is dropped when its session finishes.

Simplifications: a completion is "finished" or "failed" only (a cancelled sample is "failed"; its `retrieve_future`
says why); a finished one carries its payload's size in bytes (the SDK reserves that much of its in-flight budget
before the fetch). No torch, no SDK: `tidal.tinker.app` turns these records into the SDK's response models.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass

log = logging.getLogger("tidal.tinker")
CLONE_BLOCK = 1_000_000_000
"""The SDK numbers a clone's sample requests from `CLONE_BLOCK * cloned_sampler_id`."""
LONG_POLL_S = 25.0
"""How long a poll without a `timeout` waits for a completion (the SDK's HTTP timeout for one poll is 45 s)."""
MAX_KEPT = 1 << 16
"""Completions kept per target at most (a few MB); the SDK's poller acknowledges them as soon as it reads them."""


@dataclass(frozen=True)
class Completion:
    """A finished (`failed` False, with its payload's `size`) or failed request of a target, at `cursor`."""

    cursor: int
    request_id: str
    failed: bool
    size: int | None = None


def clone_of(seq: int) -> int:
    """The clone (`cloned_sampler_id`) that sent sample request `seq`."""
    return seq // CLONE_BLOCK


class CompletionQueue:
    """One target's completions after the newest cursor its poller has seen."""

    def __init__(self, cursors: Iterator[int], max_kept: int = MAX_KEPT) -> None:
        self.max_kept = max_kept
        self._events: deque[Completion] = deque()
        self._cursors = cursors
        self._wake = asyncio.Event()
        self.owned: OrderedDict[str, None] = OrderedDict()
        """Request ids this target was sent (bounded like the queue): the only ids an acknowledgement may free."""

    def expect(self, request_id: str) -> None:
        """`request_id` is a request of this target (its completion comes later)."""
        self.owned[request_id] = None
        while len(self.owned) > self.max_kept:
            self.owned.popitem(last=False)

    def push(self, request_id: str, failed: bool, size: int | None = None) -> None:
        """Record that `request_id` finished (or failed) and wake the waiting poll. Call on the event loop."""
        self._events.append(Completion(next(self._cursors), request_id, failed, None if failed else size))
        if len(self._events) > self.max_kept:
            lost = self._events.popleft()
            log.warning("retrieve_futures: %d completions nobody polled for; dropped the oldest (%s)",
                        self.max_kept, lost.request_id)
        self._wake.set()

    def trim(self, prev_cursor: int) -> None:
        """Drop the completions at or before `prev_cursor` (the poller has seen them)."""
        while self._events and self._events[0].cursor <= prev_cursor:
            self._events.popleft()

    async def poll(self, prev_cursor: int, timeout: float | None) -> tuple[list[Completion], int]:
        """(the completions after `prev_cursor`, the cursor to pass back), waiting up to `timeout` seconds (None:
        `LONG_POLL_S`) for one when there is none yet."""
        self.trim(prev_cursor)
        wait = LONG_POLL_S if timeout is None else min(max(timeout, 0.0), LONG_POLL_S)
        if not self._events and wait > 0:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
            except (TimeoutError, asyncio.TimeoutError):
                pass
            self.trim(prev_cursor)
        out = list(self._events)
        return out, max([prev_cursor] + [c.cursor for c in out])

    def __len__(self) -> int:
        return len(self._events)


class Completions:
    """The completion queues of every target: (sampling session id, cloned_sampler_id) -> `CompletionQueue`."""

    def __init__(self, max_kept: int = MAX_KEPT) -> None:
        self.max_kept = max_kept
        self.queues: dict[tuple[str, int], CompletionQueue] = {}
        self._cursors = itertools.count(1)
        """One cursor sequence for every queue: a queue made again after `drop_idle` never numbers a completion
        at or below a cursor its poller already holds."""

    def queue(self, sampling_session_id: str, clone: int) -> CompletionQueue:
        key = (sampling_session_id, clone)
        if key not in self.queues:
            self.queues[key] = CompletionQueue(self._cursors, self.max_kept)
        return self.queues[key]

    def drop_idle(self, sampling_session_id: str) -> None:
        """Forget the queues of `sampling_session_id` that hold nothing and expect nothing (its session finished;
        a clone still sampling keeps its queue, and a later poll starts an empty one)."""
        for key in [k for k, q in self.queues.items() if k[0] == sampling_session_id and not q and not q.owned]:
            del self.queues[key]


class Joins:
    """The client ids (`client_counter`) of each sampling session's joined clients: 1, 2, 3, ... (0 is the client
    that created the session), so that no two clones send the same `seq_id`s."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def join(self, sampling_session_id: str) -> int:
        n = self._last.get(sampling_session_id, 0) + 1
        self._last[sampling_session_id] = n
        return n
