"""The vLLM client sends a request again when its connection could not be made (it never reached the server), and
never when the server may have it (`tidal.inference.backends.vllm.client.CONNECT_RETRY_WAITS_S`). Real sockets: a
port nobody listens on yet, an HTTP server that starts late, a server that drops the connection after reading."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tidal.config.orch import ClientSection
from tidal.inference.backends.vllm import client as client_mod
from tidal.inference.backends.vllm.client import VllmClient
from tidal.inference.protocol import InferenceError
from tidal.procs import free_port


class Answer(BaseHTTPRequestHandler):
    seen = 0

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        type(self).seen += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        out = json.dumps({"echo": body}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: object) -> None:
        pass


class Drop(Answer):
    def do_POST(self) -> None:  # noqa: N802
        type(self).seen += 1
        self.rfile.read(int(self.headers["Content-Length"]))
        self.connection.shutdown(socket.SHUT_RDWR)  # the server had the request: the client must not resend it


def post(port: int, payload: dict) -> tuple[object, int, float]:
    async def go() -> tuple[object, int, float]:
        client = VllmClient(ClientSection(base_url=[f"http://127.0.0.1:{port}/v1"]))
        t0 = time.monotonic()
        try:
            return await client._post(f"http://127.0.0.1:{port}/v1/completions", payload), client.connect_retries, \
                time.monotonic() - t0
        finally:
            await client.close()

    return asyncio.run(go())


def test_a_request_whose_connection_failed_is_sent_again_and_answered(monkeypatch):
    monkeypatch.setattr(client_mod, "CONNECT_RETRY_WAITS_S", (0.3, 0.3, 0.3, 0.3))
    port = free_port()
    servers: list[ThreadingHTTPServer] = []

    def start_late() -> None:
        time.sleep(0.5)  # the first attempts are refused: nothing listens yet
        servers.append(ThreadingHTTPServer(("127.0.0.1", port), Answer))
        servers[0].serve_forever()

    threading.Thread(target=start_late, daemon=True).start()
    Answer.seen = 0
    try:
        got, retries, _ = post(port, {"prompt": [1, 2, 3]})
    finally:
        while not servers:
            time.sleep(0.05)
        servers[0].shutdown()
    assert got == {"echo": {"prompt": [1, 2, 3]}} and retries >= 1 and Answer.seen == 1


def test_no_connection_after_the_last_wait_is_an_inference_error(monkeypatch):
    monkeypatch.setattr(client_mod, "CONNECT_RETRY_WAITS_S", (0.1, 0.2))
    with pytest.raises(InferenceError, match="no connection in 3 attempts"):
        post(free_port(), {})


def test_a_request_the_server_may_have_is_never_sent_again():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Drop)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    Drop.seen = 0
    try:
        with pytest.raises(InferenceError, match="failed"):
            post(srv.server_address[1], {"prompt": [1]})
    finally:
        srv.shutdown()
    assert Drop.seen == 1
