"""The real Tinker SDK (tinker==0.38.0, unchanged) through a faulty link: every training request is applied exactly
once under the SDK's retries.

The link is this test's own HTTP proxy on loopback (`FaultyLink`: a threaded relay, at most `MAX_RELAYS` requests
at a time): it forwards every request to tidal's Tinker server in this process (the training side of
tests/integration/test_tinker_server.py: the real trainer on the bundled model, no vLLM) and, on the requests its
plan names, answers the SDK with a 502 after the server took the request, or cuts the connection in the middle of
the response body. The SDK then resends the request with the same `seq_id`. Two clients restored from one saved
state run the same loop, one over the clean link and one over the faulty one; their fp32 LoRA weights must end bit
for bit equal (a request applied twice accumulates its gradients twice, or steps twice)."""

from __future__ import annotations

import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.integration.test_tinker_server import KEY, datums, server  # noqa: E402, F401

FWDBWD, OPTIM, RETRIEVE = "/api/v1/forward_backward", "/api/v1/optim_step", "/api/v1/retrieve_future"
MAX_RELAYS = 16
HOP = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding", "keep-alive"}


class FaultyLink:
    """A loopback proxy to `upstream` that breaks the responses its `plan` names: (path, n-th arrival of that path)
    -> `"502"` (forward, then answer 502) or `"cut"` (forward, then send half the body and close)."""

    def __init__(self, upstream: str, plan: dict[tuple[str, int], str]) -> None:
        self.upstream, self.plan = upstream, plan
        self.arrivals: Counter[str] = Counter()
        self.broken: list[tuple[str, int, str]] = []
        self.encodings: list[str | None] = []
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(MAX_RELAYS)
        self.http = httpx.Client(timeout=120.0)
        link = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                with link.slots:
                    link.relay(self)

            do_POST = do_GET

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def relay(self, h: BaseHTTPRequestHandler) -> None:
        size = int(h.headers.get("content-length") or 0)
        body = h.rfile.read(size) if size else b""
        with self.lock:
            self.arrivals[h.path] += 1
            n = self.arrivals[h.path]
            fault = self.plan.get((h.path, n))
            if h.path == FWDBWD:
                self.encodings.append(h.headers.get("content-encoding"))
        headers = {k: v for k, v in h.headers.items() if k.lower() not in HOP}
        r = self.http.request(h.command, self.upstream + h.path, content=body, headers=headers)
        status, data, ctype = r.status_code, r.content, r.headers.get("content-type", "application/json")
        if fault == "502":
            status, data, ctype = 502, b'{"detail": "bad gateway (the test\'s faulty link)"}', "application/json"
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if fault == "cut":
            h.wfile.write(data[: len(data) // 2])
            h.close_connection = True
        else:
            h.wfile.write(data)
        h.wfile.flush()
        if fault is not None:
            with self.lock:
                self.broken.append((h.path, n, fault))

    def __enter__(self) -> FaultyLink:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.http.close()


def loop(tc, steps: int = 3) -> None:  # type: ignore[no-untyped-def]
    adam = types.AdamParams(learning_rate=5e-3)
    for step in range(steps):
        fb = tc.forward_backward(datums(40 + step), "importance_sampling")
        opt = tc.optim_step(adam)
        fb.result()
        opt.result()


def weights(service, model_id: str) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    service.worker.submit(lambda: None).result()  # after every queued request
    return {k: p.detach().clone() for k, p in service.trainer.adapters[model_id].params.items()}


PLAN = {(FWDBWD, 2): "502", (OPTIM, 1): "502", (FWDBWD, 4): "cut", (RETRIEVE, 5): "cut"}
"""The 2nd forward_backward (step 2) and the 1st optim_step lose their responses after the server took them; the
first copy of step 3's forward_backward loses its connection mid-body (arrival 3 is step 2's retry); so does one
poll of a result (the SDK polls again; a finished future stays retrievable)."""


def test_training_is_applied_exactly_once_through_a_faulty_link(server):  # noqa: F811
    url, facts, service = server
    base = tinker.ServiceClient(base_url=url, api_key=KEY)
    start = base.create_lora_training_client(base_model=facts.served_name, rank=8, seed=3).result()
    path = start.save_state("retries-start").result().path
    clean = base.create_training_client_from_state_with_optimizer(path).result()
    loop(clean)
    with FaultyLink(url, PLAN) as link:
        faulty_sc = tinker.ServiceClient(base_url=link.url, api_key=KEY)
        faulty = faulty_sc.create_training_client_from_state_with_optimizer(path).result()
        loop(faulty)
        probe = datums(50, with_rl=False)
        lp_faulty = faulty.forward(probe, "cross_entropy").result().metrics["loss:sum"]
        got = weights(service, faulty.model_id)
        faulty_sc.close("success").result()
    assert sorted(link.broken) == sorted((p, n, f) for (p, n), f in PLAN.items())
    # 3 steps + the probe's forward (the same route), and each broken request resent once
    assert link.arrivals[FWDBWD] == 3 + 1 + 2 and link.arrivals[OPTIM] == 3 + 1
    want = weights(service, clean.model_id)
    assert set(got) == set(want) and want
    moved = weights(service, start.model_id)
    assert any(not torch.equal(want[k], moved[k]) for k in want)  # the loop trained
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k}: a retried request was applied twice"
    assert lp_faulty == clean.forward(probe, "cross_entropy").result().metrics["loss:sum"]
    assert set(link.encodings) == {"zstd"}  # the SDK compresses forward_backward bodies for this server
    base.close("success").result()


def test_a_resent_request_gets_its_first_future_and_a_gap_waits(server):  # noqa: F811
    """The protocol under the SDK, by hand: the same seq_id twice is one future; seq_id 3 before 2 waits for 2; a
    seq_id older than the window kept is refused."""
    url, facts, service = server
    sc = tinker.ServiceClient(base_url=url, api_key=KEY)
    tc = sc.create_lora_training_client(base_model=facts.served_name, rank=4, seed=0).result()
    h = {"X-API-Key": KEY}

    def optim(seq: int) -> httpx.Response:
        body = types.OptimStepRequest(model_id=tc.model_id, seq_id=seq, optim_params=types.AdamParams())
        return httpx.post(f"{url}/api/v1/optim_step", headers=h, json=body.model_dump(mode="json"))

    first, again = optim(1).json(), optim(1).json()
    assert first["request_id"] == again["request_id"]
    steps = service.trainer.adapters[tc.model_id]
    early = optim(3).json()["request_id"]
    assert service.futures[early].done() is False and service.ledger.last(tc.model_id) == 1
    second = optim(2).json()["request_id"]
    for rid in (first["request_id"], second, early):
        service.futures[rid].result(timeout=60)
    assert steps.steps == 3 and service.ledger.last(tc.model_id) == 3
    service.ledger.window = 2
    try:
        optim(4)
        optim(5)
        optim(6)
        r = optim(1)
    finally:
        service.ledger.window = 1024
    assert r.status_code == 400 and "older than" in r.json()["detail"]
    service.worker.submit(lambda: None).result()
    assert steps.steps == 6
    sc.close("success").result()


def test_sampling_retries_get_their_first_session_and_future(server):  # noqa: F811
    """A resent create_sampling_session (same sampling_session_seq_id) and a resent sample (same seq_id in the same
    sampling session) get what their first copy got. This server has no vLLM, so the sample's future fails later;
    its id and sequence ids are what the SDK holds on to."""
    url, facts, service = server
    h = {"X-API-Key": KEY}
    sid = httpx.post(f"{url}/api/v1/create_session", headers=h, json=types.CreateSessionRequest(
        tags=[], user_metadata=None, sdk_version="0.38.0").model_dump(mode="json")).json()["session_id"]

    def session(seq: int) -> str:
        body = types.CreateSamplingSessionRequest(session_id=sid, sampling_session_seq_id=seq,
                                                  base_model=facts.served_name)
        r = httpx.post(f"{url}/api/v1/create_sampling_session", headers=h, json=body.model_dump(mode="json"))
        return str(r.json()["sampling_session_id"])

    first = session(0)
    assert session(0) == first and session(1) != first

    def sample(seq: int) -> dict:  # type: ignore[type-arg]
        body = types.SampleRequest(sampling_session_id=first, seq_id=seq, num_samples=2,
                                   prompt=types.ModelInput.from_ints([1, 2, 3]),
                                   sampling_params=types.SamplingParams(max_tokens=2))
        return dict(httpx.post(f"{url}/api/v1/asample", headers=h, json=body.model_dump(mode="json")).json())

    a, again, other = sample(7), sample(7), sample(8)
    assert a == again and len(a["sample_sequence_ids"]) == 2
    assert other["request_id"] != a["request_id"]
    assert service.sample_ids.seen(first, 7) == a["request_id"]


def test_a_refused_request_takes_its_seq_id_so_the_next_one_runs(server):  # noqa: F811
    """The SDK goes on after a refusal, with the next seq_id: a forward_backward refused for its body (an image
    chunk) and a save_weights_external (a route tidal lacks) take theirs, so what follows runs at once instead of
    waiting for a request that will never come."""
    from tinker.proto.request_conv import forward_backward_request_to_proto

    url, facts, service = server
    sc = tinker.ServiceClient(base_url=url, api_key=KEY)
    tc = sc.create_lora_training_client(base_model=facts.served_name, rank=4, seed=0).result()
    h = {"X-API-Key": KEY}
    image = types.Datum(model_input=types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG", format="png")]),
                        loss_fn_inputs={"target_tokens": [1]})
    msg = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[image], loss_fn="cross_entropy"),
        model_id=tc.model_id, seq_id=1))
    r = httpx.post(f"{url}/api/v1/forward_backward", headers={**h, "content-type": "application/x-protobuf"},
                   content=msg.SerializeToString())
    assert r.status_code == 400 and "image" in r.json()["detail"].lower()
    r = httpx.post(f"{url}/api/v1/save_weights_external", headers=h, json=types.SaveWeightsExternalRequest(
        model_id=tc.model_id, path="x", seq_id=2, age_encryption_recipients=["age1x"]).model_dump(mode="json"))
    assert r.status_code == 404
    assert service.ledger.last(tc.model_id) == 2
    # the next request, by hand (this SDK client never sent 1 and 2 itself)
    body = types.OptimStepRequest(model_id=tc.model_id, seq_id=3, optim_params=types.AdamParams())
    rid = httpx.post(f"{url}/api/v1/optim_step", headers=h, json=body.model_dump(mode="json")).json()["request_id"]
    service.futures[rid].result(timeout=60)  # ran at once: not held behind a gap
    assert service.trainer.adapters[tc.model_id].steps == 1
    sc.close("success").result()
