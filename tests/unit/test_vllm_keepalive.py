"""tidal's HTTP clients of vLLM drop an idle connection before vLLM's server closes it (`KEEPALIVE_S` below the
installed vLLM's `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`): with equal timeouts a request after a quiet spell could be sent on a
connection the server was closing (`ReadError('')`, which ended a bench's `tidal eval`)."""

from __future__ import annotations

import asyncio

import pytest

from tidal.config.orch import ClientSection
from tidal.inference.backends.vllm.client import KEEPALIVE_S, VllmClient


def test_the_client_keeps_idle_connections_shorter_than_vllm_does(monkeypatch):
    envs = pytest.importorskip("vllm.envs")
    monkeypatch.delenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", raising=False)
    assert KEEPALIVE_S < envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    client = VllmClient(ClientSection(base_url=["http://127.0.0.1:9/v1"]))
    try:
        assert client.http._transport._pool._keepalive_expiry == KEEPALIVE_S
    finally:
        asyncio.run(client.close())
