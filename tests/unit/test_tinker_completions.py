"""tidal.tinker.completions: what `retrieve_futures` answers (cursor, trim, long poll, bound) and the clone ids of
`join_sampling_session`."""

from __future__ import annotations

import asyncio
import time

from tidal.tinker.completions import CLONE_BLOCK, Completions, Joins, clone_of


def test_a_poll_returns_what_came_after_its_cursor_until_the_next_poll_has_seen_it():
    async def main() -> None:
        c = Completions()
        q = c.queue("s", 0)
        q.push("r1", failed=False, size=10)
        q.push("r2", failed=True, size=99)
        got, cursor = await q.poll(0, None)
        assert [(x.request_id, x.failed, x.size) for x in got] == [("r1", False, 10), ("r2", True, None)]
        again, same = await q.poll(0, 0)  # the answer was lost: the same poll gets the same completions
        assert again == got and same == cursor
        q.push("r3", failed=False, size=1)
        nxt, cursor2 = await q.poll(cursor, 0)  # the poller saw r1, r2
        assert [x.request_id for x in nxt] == ["r3"] and cursor2 > cursor and len(q) == 1
        empty, cursor3 = await q.poll(cursor2, 0)
        assert empty == [] and cursor3 == cursor2 and len(q) == 0

    asyncio.run(main())


def test_a_long_poll_wakes_at_the_next_completion_and_times_out_without_one():
    async def main() -> None:
        q = Completions().queue("s", 0)
        t0 = time.monotonic()
        got, cursor = await q.poll(0, 0.2)
        assert got == [] and cursor == 0 and 0.15 < time.monotonic() - t0 < 2
        asyncio.get_running_loop().call_later(0.1, q.push, "late", False, 3)
        t0 = time.monotonic()
        got, cursor = await q.poll(0, 20)
        assert [x.request_id for x in got] == ["late"] and cursor == got[0].cursor
        assert time.monotonic() - t0 < 5  # woken, not timed out

    asyncio.run(main())


def test_clones_have_their_own_queues_and_cursors_never_repeat_after_a_drop():
    async def main() -> None:
        c = Completions(max_kept=3)
        a, b = c.queue("s", 0), c.queue("s", 1)
        a.push("a1", False, 1)
        b.push("b1", False, 1)
        (ga,), ca = await a.poll(0, 0)
        (gb,), cb = await b.poll(0, 0)
        assert (ga.request_id, gb.request_id) == ("a1", "b1") and ca != cb
        await b.poll(cb, 0)
        b.expect("b2")
        c.drop_idle("s")  # a still holds a1 (not acknowledged), b expects b2
        assert set(c.queues) == {("s", 0), ("s", 1)}
        await a.poll(ca, 0)
        del b.owned["b2"]
        c.drop_idle("s")
        assert c.queues == {}
        fresh = c.queue("s", 1)
        fresh.push("b3", False, 1)
        got, _ = await fresh.poll(cb, 0)  # the poller kept its cursor: the new queue's completion is after it
        assert [x.request_id for x in got] == ["b3"]
        for i in range(5):
            fresh.push(f"x{i}", False, 1)
        got, _ = await fresh.poll(cb, 0)
        assert [x.request_id for x in got] == ["x2", "x3", "x4"]  # bounded: the oldest went

    asyncio.run(main())


def test_clone_ids_follow_the_sdk_blocks_and_joins_never_repeat():
    assert [clone_of(s) for s in (0, CLONE_BLOCK - 1, CLONE_BLOCK, 3 * CLONE_BLOCK + 7)] == [0, 0, 1, 3]
    j = Joins()
    assert [j.join("s"), j.join("s"), j.join("t"), j.join("s")] == [1, 2, 1, 3]
