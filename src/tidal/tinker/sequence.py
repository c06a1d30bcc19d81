"""Exactly-once bookkeeping of the Tinker server: which request ids a client's numbered requests already got.

The Tinker SDK numbers a training client's requests (forward_backward chunks, forward, optim_step, save_state,
load_state, save_weights_for_sampler) `seq_id` 1, 2, 3, ... per model id, and resends a request with the same
`seq_id` when its response does not arrive (`execute_with_retries`: connection errors, timeouts, 408/409/429/5xx,
for up to 5 minutes; and the HTTP client's own retries). It sends request N+1 only after request N was accepted
(`TrainingClient._take_turn`), and with `parallel_fwdbwd_chunks` it relies on the server holding a later chunk until
the earlier ones arrive ("seq_id ordering"). So, per key:

- a `seq_id` seen before gets the request id it got the first time (`Verdict.rid`): the same future, finished or
  running, never a second run;
- the next `seq_id` runs (`Verdict.run`);
- a `seq_id` past the next one (a gap) waits until the missing ones arrive (`Verdict.hold`), up to `GAP_S`;
- a `seq_id` older than the `WINDOW` kept is refused (`SeqError`): its result is long gone and running it again
  would apply it twice.

Sampling requests are numbered per sampling session (`SampleRequest.seq_id`, not necessarily contiguous across
clones of one client), so they only use `seen` / `remember` (no order). Every table is bounded (`WINDOW` ids per
key) and dropped with its key, so a week-long loop holds constant memory here.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

WINDOW = 1024
"""Request ids kept per key: far more than the SDK can have in flight (it waits for each acceptance)."""
GAP_S = 300.0
"""How long a request after a gap waits for the missing ones (the SDK's own retry horizon)."""


class SeqError(ValueError):
    """A numbered request that cannot be applied exactly once (the message says why)."""


@dataclass(frozen=True)
class Verdict:
    """What to do with a numbered request: return `rid` (seen before), `run` it now, or `hold` it."""

    rid: str | None = None
    run: bool = False
    hold: bool = False


class Ledger:
    """Per key (a model id or a sampling session id): the request id of each recent `seq_id`, and the newest."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._ids: dict[str, OrderedDict[int, str]] = {}
        self._last: dict[str, int] = {}

    def last(self, key: str) -> int:
        """The newest `seq_id` accepted in order for `key` (0: none yet)."""
        return self._last.get(key, 0)

    def seen(self, key: str, seq: int) -> str | None:
        """The request id `seq` got the first time, or None."""
        return self._ids.get(key, OrderedDict()).get(seq)

    def check(self, key: str, seq: int) -> Verdict:
        """The verdict for training request `seq` of `key` (`SeqError` for one too old to tell)."""
        if seq < 1:
            raise SeqError(f"seq_id {seq} for {key}: the Tinker SDK numbers a client's requests from 1")
        rid = self.seen(key, seq)
        if rid is not None:
            return Verdict(rid=rid)
        last = self.last(key)
        if seq == last + 1:
            return Verdict(run=True)
        if seq > last + 1:
            return Verdict(hold=True)
        raise SeqError(f"seq_id {seq} for {key} is older than the {self.window} requests this server remembers "
                       f"(the newest applied is {last}); it was applied already and is not run again")

    def remember(self, key: str, seq: int, rid: str, *, in_order: bool = True) -> None:
        """Record that `seq` of `key` got `rid`; `in_order` advances the newest accepted `seq_id`."""
        ids = self._ids.setdefault(key, OrderedDict())
        ids[seq] = rid
        while len(ids) > self.window:
            ids.popitem(last=False)
        if in_order:
            self._last[key] = max(seq, self.last(key))

    def drop(self, key: str) -> None:
        """Forget `key` (its model or sampling session is gone)."""
        self._ids.pop(key, None)
        self._last.pop(key, None)

    def __len__(self) -> int:
        return sum(len(v) for v in self._ids.values())
