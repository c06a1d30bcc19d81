"""`client.api_key_var`, `client.timeout` and `client.skip_model_check` against a real local HTTP server
that records what it receives (a slow server is the failure vLLM cannot be made to produce on demand)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tidal.config.orch import ClientSection
from tidal.inference.backends.vllm.client import VllmClient
from tidal.inference.protocol import InferenceError

SEEN: list[tuple[str, str | None]] = []


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        return

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        SEEN.append((self.path, self.headers.get("Authorization")))
        self._reply({"data": [{"id": "m"}]} if self.path == "/v1/models" else {})

    def do_POST(self):  # noqa: N802
        SEEN.append((self.path, self.headers.get("Authorization")))
        time.sleep(3)  # slower than the client's timeout
        self._reply({})


@pytest.fixture()
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    SEEN.clear()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1"
    srv.shutdown()


def run(coro_fn):
    return asyncio.run(coro_fn())


def test_api_key_comes_from_the_named_variable(server, monkeypatch):
    monkeypatch.setenv("MY_INFER_KEY", "k-123")

    async def go():
        client = VllmClient(ClientSection(base_url=[server], api_key_var="MY_INFER_KEY"))
        try:
            return await client.wait_ready()
        finally:
            await client.close()

    assert run(go) == ["m"]
    assert SEEN[-1] == ("/v1/models", "Bearer k-123")


def test_skip_model_check_probes_health_instead_of_models(server):
    async def go():
        client = VllmClient(ClientSection(base_url=[server], skip_model_check=True))
        try:
            return await client.wait_ready()
        finally:
            await client.close()

    assert run(go) == [] and SEEN[-1][0] == "/health"


def test_request_timeout_is_honoured(server):
    async def go():
        client = VllmClient(ClientSection(base_url=[server], timeout=0.5))
        try:
            t0 = time.monotonic()
            with pytest.raises(InferenceError, match="Timeout"):
                await client.sample("m", [1, 2], 1, 4, 1.0)
            return time.monotonic() - t0
        finally:
            await client.close()

    assert run(go) < 2.5
