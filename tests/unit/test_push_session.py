"""What every weight pusher shares (`tidal.trainer.publish.session.PushSession`), on a fake engine (no server): the
group kept between pushes and closed by a failed one, a failed push after a step logged and not raised, and the
orchestrator's re-push request served with the pusher's own retry state."""

from __future__ import annotations

import pytest
import torch

from tidal.trainer.publish import session
from tidal.trainer.publish.push import Pusher
from tidal.trainer.publish.session import PushSession
from tidal.transport import weights


class FakeEngine(PushSession):
    """Records what it was asked to do; `down` makes every transfer fail (a dead server)."""

    def __init__(self) -> None:
        super().__init__(["http://127.0.0.1:9/v1/"], "127.0.0.1", 0, 1.0, None, torch.device("cpu"))
        self.down = False
        self.opened = self.closed = 0
        self.sent: list[int] = []

    def _open(self) -> None:
        self.opened += 1
        self.group = object()

    def _transfer(self, model: torch.nn.Module, step: int) -> None:
        if self.down:
            raise ConnectionError("server down")
        self.sent.append(step)

    def close(self) -> None:
        self.closed += 1
        self.group = None


MODEL = torch.nn.Linear(1, 1)


def test_the_session_takes_the_servers_roots_and_keeps_the_group_until_a_push_fails():
    pusher: Pusher = FakeEngine()
    assert isinstance(pusher, FakeEngine) and pusher.roots == ["http://127.0.0.1:9"]
    pusher.push(MODEL, 1)
    pusher.push(MODEL, 2)
    assert (pusher.opened, pusher.sent, pusher.pushed) == (1, [1, 2], 2)
    pusher.down = True
    with pytest.raises(ConnectionError):
        pusher.push(MODEL, 3)
    assert pusher.group is None and pusher.closed == 1 and pusher.pushed == 2
    pusher.down = False
    pusher.push(MODEL, 3)
    assert pusher.opened == 2 and pusher.pushed == 3


def test_a_failed_push_after_a_step_is_not_fatal_and_a_served_push_clears_an_older_request(tmp_path):
    pusher = FakeEngine()
    pusher.down = True
    assert pusher.push_policy(MODEL, tmp_path, 1) == 0.0
    weights.request_push(tmp_path, 1, "restarted")
    pusher.down = False
    pusher.push_policy(MODEL, tmp_path, 2)
    assert weights.push_requested(tmp_path) is None, "policy 2 also serves the request for policy 1"
    weights.request_push(tmp_path, 3, "restarted")
    pusher.push_policy(MODEL, tmp_path, 2)
    assert weights.push_requested(tmp_path) == 3, "a request for a newer policy stays"


def test_a_push_request_is_retried_with_the_pushers_own_failure_count(tmp_path, monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(session.time, "sleep", sleeps.append)
    pusher = FakeEngine()
    pusher.serve_push_request(MODEL, tmp_path, 4)
    assert pusher.sent == [], "nothing asked"
    weights.request_push(tmp_path, 5, "restarted")
    pusher.serve_push_request(MODEL, tmp_path, 4)
    assert pusher.sent == [], "policy 5 is not trained yet"
    weights.request_push(tmp_path, 4, "restarted")
    pusher.serve_push_request(MODEL, tmp_path, 0)
    assert pusher.sent == [], "policy 0 is the base: never pushed"
    pusher.down = True
    for _ in range(3):
        pusher.serve_push_request(MODEL, tmp_path, 4)
    assert pusher.failures == 3 and sleeps == [2.0] * 3 and weights.push_requested(tmp_path) == 4
    pusher.down = False
    pusher.serve_push_request(MODEL, tmp_path, 4)
    assert pusher.sent == [4] and pusher.failures == 0 and weights.push_requested(tmp_path) is None
