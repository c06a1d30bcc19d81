"""The real Tinker SDK (tinker==0.38.0, unchanged) with the two sampling options tidal's server offers:
`sample_use_retrieve_futures` (one `retrieve_futures` poller per sampling client) and
`sample_join_sampling_session` (the server gives an unpickled client its clone id).

The server is the in-process one of tests/integration/test_tinker_server.py (real trainer, no vLLM), seen through
the counting, faulty proxy of tests/integration/test_tinker_retries.py. Without vLLM every sample fails on the
server (connection refused), which is a real outcome the poller must carry: the SDK learns of it from
`retrieve_futures` and raises the server's message. A sample that succeeds, payload and all, through the same
poller is checked with vLLM in tests/integration/test_tinker_loops.py."""

from __future__ import annotations

import time

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.integration.test_tinker_retries import RETRIEVE, FaultyLink  # noqa: E402
from tests.integration.test_tinker_server import KEY, server  # noqa: E402, F401
from tidal.tinker.completions import CLONE_BLOCK  # noqa: E402

FUTURES, JOIN = "/api/v1/retrieve_futures", "/api/v1/join_sampling_session"
PROMPT, PARAMS = types.ModelInput.from_ints([1, 2, 3]), types.SamplingParams(max_tokens=2)


def wait_until(cond, timeout: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_the_sdk_learns_of_a_sample_through_retrieve_futures_even_when_a_poll_is_cut(server):  # noqa: F811
    url, facts, service = server
    with FaultyLink(url, {(FUTURES, 1): "cut"}) as link:
        sc = tinker.ServiceClient(base_url=link.url, api_key=KEY)
        sampler = sc.create_sampling_client(base_model=facts.served_name).result()
        with pytest.raises(tinker.RequestFailedError, match="vLLM /v1/completions failed"):
            sampler.sample(PROMPT, 2, PARAMS).result(timeout=60)
        sid = sampler._sampling_session_id
        rid = service.sample_ids.seen(sid, 0)  # the original client's first seq_id is 0
        assert rid is not None
        # the poller read the completion (its first answer was cut: it polled again with the same cursor), then
        # fetched the result once with retrieve_future, then acknowledged it: the server freed the future
        assert wait_until(lambda: rid not in service.futures)
        assert link.broken == [(FUTURES, 1, "cut")] and link.arrivals[FUTURES] >= 2
        assert link.arrivals[RETRIEVE] == 1
        queue = service.completions.queues[(sid, 0)]
        assert len(queue) == 0 and not queue.owned  # read, acknowledged, nothing left
        sc.close("success").result()


def test_unpickled_clients_join_with_server_given_clone_ids_and_poll_their_own_queue(server):  # noqa: F811
    url, facts, service = server
    with FaultyLink(url, {}) as link:
        sc = tinker.ServiceClient(base_url=link.url, api_key=KEY)
        original = sc.create_sampling_client(base_model=facts.served_name).result()
        handle = original.get_sampler_handle()
        clones = [tinker.SamplingClient.from_sampler_handle(handle, api_key=KEY) for _ in range(2)]
        for c in clones:
            with pytest.raises(tinker.RequestFailedError, match="vLLM"):
                c.sample(PROMPT, 1, PARAMS).result(timeout=60)
        sid = original._sampling_session_id
        assert [c._cloned_sampler_id for c in clones] == [1, 2] and link.arrivals[JOIN] == 2
        for clone in (1, 2):  # each clone's first seq_id opens its block, and its completion went to its queue
            assert service.sample_ids.seen(sid, clone * CLONE_BLOCK) is not None
            assert (sid, clone) in service.completions.queues
        with pytest.raises(tinker.RequestFailedError):
            original.sample(PROMPT, 1, PARAMS).result(timeout=60)
        assert link.arrivals[JOIN] == 2  # the creating client is clone 0 and never joins
        assert service.sample_ids.seen(sid, 0) is not None
        r = link.http.post(f"{url}{JOIN}", headers={"X-API-Key": KEY},
                           json=types.JoinSamplingSessionRequest(sampling_session_id="nope").model_dump(mode="json"))
        assert r.status_code == 400 and "unknown sampling_session_id" in r.json()["detail"]
        for c in clones:  # each rebuilt client has its own holder: its session heartbeat would outlive the server
            c.holder.close()
        sc.close("success").result()
