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


def test_a_model_whose_gap_expired_goes_on_and_a_late_request_is_not_run(monkeypatch, tmp_path):
    """Issue 66: after a gap expired (seq_id 2 never came, 3 failed after `GAP_S`) the model never advanced again:
    4, 5, ... each waited for 2 and failed. Now the expired gap closes: 3 fails naming 2, the model goes on with 4,
    and a late 2 gets a refusal (never run after 3: a request is applied at most once, and in order)."""
    import asyncio

    import tidal.tinker.service as service

    monkeypatch.setattr(service, "GAP_S", 0.05)
    svc = service.TinkerService("m", str(tmp_path), "LlamaForCausalLM", 64, None, None, tmp_path, 8, set(), "m")
    ran: list[int] = []

    def job(seq: int) -> service.Run:
        return lambda: ran.append(seq) or service.Result(data={"seq": seq})

    async def scenario() -> None:
        one = svc.submit_seq("m", 1, lambda: job(1))
        three = svc.submit_seq("m", 3, lambda: job(3))  # 2 missing: held
        await asyncio.sleep(0.2)  # the gap expires
        assert svc.futures[one].result(5).data == {"seq": 1}
        with pytest.raises(SeqError, match="seq_id 3 .* seq_id 2, which never arrived"):
            svc.futures[three].result(5)
        four = svc.submit_seq("m", 4, lambda: job(4))
        assert svc.futures[four].result(5).data == {"seq": 4}, "the model goes on after the expired gap"
        late = svc.submit_seq("m", 2, lambda: job(2))
        with pytest.raises(SeqError, match="seq_id 2 .* did not arrive"):
            svc.futures[late].result(5)
        five = svc.submit_seq("m", 5, lambda: job(5))
        assert svc.futures[five].result(5).data == {"seq": 5}

    try:
        asyncio.run(scenario())
    finally:
        svc.worker.shutdown(wait=True)
    assert ran == [1, 4, 5]
