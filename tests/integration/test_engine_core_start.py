"""Issue 68, infer `engine_core_start`: a real `tidal grpo-infer` on the bundled model (LoRA on, tidal's in-engine
worker) forks vLLM's engine core from its API server by default (`auto`) instead of spawning it, and serves from it;
timing-free evidence: the engine core says so naming its parent, which is the server `tidal grpo-infer` became
(exec keeps the pid); with `spawn` no such line. Ctrl-C or kill -9 to the API server alone still ends the engine
core (no orphan)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL, free_port, kill_group, tidal, wait_healthy
from tidal.inference.backends.vllm.fork_core import FORKED_LINE

pytestmark = pytest.mark.vllm


def children(pid: int) -> list[int]:
    kids = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in kids.read_text().split()] if kids.exists() else []


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def start(tmp_path: Path, *args: str):
    port, log = free_port(), tmp_path / "infer.log"
    f = open(log, "w")  # noqa: SIM115 - closed by the test
    proc = tidal("grpo-infer", "--infer.port", str(port), *args, stdout=f)
    try:
        wait_healthy(port, proc)
    except Exception:
        kill_group(proc)
        raise RuntimeError(log.read_text()[-3000:]) from None
    return proc, port, log, f


def complete(port: int) -> list[int]:
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 8, "temperature": 1.0, "n": 4, "seed": 7,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return [len(c["text"]) for c in r.json()["choices"]]


@pytest.mark.parametrize("sig", [pytest.param(signal.SIGINT, marks=pytest.mark.slow), signal.SIGKILL],
                         ids=["ctrl-c", "kill-9"])  # ctrl-c: make test-all (default suite budget; kill-9 is the harder)
def test_the_engine_core_is_forked_from_the_api_server_serves_and_dies_with_it(tmp_path, sig):
    """ctrl-c to the API server alone: vLLM's shutdown ends the forked engine core; kill -9 of it: tidal's reaper
    (`tidal.procs.reaper`, started by `tidal grpo-infer` before it became the server) does."""
    proc, port, log, f = start(tmp_path)
    try:
        assert len(complete(port)) == 4
        text = log.read_text()
        m = re.search(re.escape(FORKED_LINE) + r" \(pid (\d+), parent (\d+)\)", text)
        assert m, text[-3000:]
        core, parent = int(m.group(1)), int(m.group(2))
        assert parent == proc.pid and core in children(proc.pid), (core, parent, proc.pid, children(proc.pid))
        os.kill(proc.pid, sig)  # to the API server alone
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{core}").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        status = Path(f"/proc/{core}/status")
        alive = status.exists() and "zombie" not in status.read_text()
        assert not alive, f"engine core {core} outlived its API server: {cmdline(core)}"
    finally:
        kill_group(proc)
        f.close()


@pytest.mark.slow  # the non-default `engine_core_start: spawn` (~40 s): make test-all
def test_spawn_keeps_vllm_cpus_own_start(tmp_path):
    proc, port, log, f = start(tmp_path, "--infer.engine_core_start", "spawn", "--infer.enable_lora", "false")
    try:
        assert len(complete(port)) == 4
        assert FORKED_LINE not in log.read_text() and children(proc.pid)
    finally:
        kill_group(proc)
        f.close()
