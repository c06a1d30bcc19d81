"""tidal.tinker.sequence: the verdicts on numbered requests (seen, next, gap, too old) and the bounded window."""

from __future__ import annotations

import pytest

from tidal.tinker.sequence import Ledger, SeqError


def test_verdicts_follow_the_sdk_numbering():
    led = Ledger(window=3)
    assert led.check("m", 1).run
    led.remember("m", 1, "r1")
    assert led.check("m", 1).rid == "r1"  # a retry
    assert led.check("m", 3).hold  # 2 is missing
    led.remember("m", 3, "r3", in_order=False)
    assert led.last("m") == 1 and led.check("m", 3).rid == "r3"
    assert led.check("m", 2).run
    led.remember("m", 2, "r2")
    led.remember("m", 3, "r3")
    assert led.last("m") == 3
    assert led.check("other", 1).run  # keys are independent
    with pytest.raises(SeqError, match="numbers a client's requests from 1"):
        led.check("m", 0)


def test_the_window_is_bounded_and_an_id_past_it_is_refused():
    led = Ledger(window=3)
    for seq in range(1, 101):
        led.remember("m", seq, f"r{seq}")
    assert len(led) == 3 and led.check("m", 100).rid == "r100"
    with pytest.raises(SeqError, match="older than the 3 requests"):
        led.check("m", 97)
    led.drop("m")
    assert len(led) == 0 and led.last("m") == 0
