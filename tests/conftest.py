"""Shared fixtures: free ports, the bundled model, and a real vLLM server (`tidal grpo-infer`) per session."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from tests.session_reaper import pytest_sessionstart  # noqa: F401  (the session's reaper: see that module)

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]
MODEL = "tidal:tiny-reverse"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# train `recipe: auto` on CPU is bf16 where the CPU has bfloat16 units (tidal.inference.precision.resolve_recipe):
# pinned to fp32 here, so that no result depends on the CPU the suite runs on (and the subprocesses inherit it);
# TIDAL_CPU_RECIPE=bf16 runs the suite in bf16 on purpose. tests/unit/test_cpu_recipe.py fakes the CPU's flags.
os.environ.setdefault("TIDAL_CPU_RECIPE", "fp32")


def on_server(url: str, call: Callable[[Any], Awaitable[T]]) -> T:
    """`call(client)` with a `VllmClient` on the server at `url` (closed afterwards), run to its result."""
    from tidal.config.orch_sections import ClientSection
    from tidal.inference.backends.vllm.client import VllmClient

    async def go() -> T:
        client = VllmClient(ClientSection(base_url=[url]))
        try:
            return await call(client)
        finally:
            await client.close()

    return asyncio.run(go())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tidal(*args: str, **kw) -> subprocess.Popen:
    """Start `python -m tidal.cli ARGS` in its own process group (so a test can kill it and its children)."""
    return subprocess.Popen([sys.executable, "-m", "tidal.cli", *args], start_new_session=True,
                            stdout=kw.pop("stdout", subprocess.PIPE), stderr=subprocess.STDOUT, text=True, **kw)


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"grpo-infer exited with {proc.returncode}:\n{out[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"vLLM on port {port} not healthy after {timeout} s")


@contextlib.contextmanager
def serving_tinker(out: Path, key: str, timeout: float = 600) -> Iterator[str]:
    """`tidal serve-tinker` on the bundled model, its log in `out`; yields its base URL once `/api/v1/healthz`
    answers, and stops it (the whole process group) afterwards."""
    port, log = free_port(), out / "serve.log"
    with open(log, "w") as f:
        proc = tidal("serve-tinker", "--port", str(port), "--api-key", key, "--output-dir", str(out), stdout=f)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while True:
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{base}/api/v1/healthz", timeout=2).status_code == 200:
                        break
                time.sleep(1)
            yield base
        finally:
            kill_group(proc)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory) -> Iterator[str]:
    """A real vLLM server on the bundled model (LoRA enabled, and vLLM's token-in/token-out `/inference/v1/generate`
    served: `--enable-scale-out` only adds routes); yields its base URL (`http://.../v1`)."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "infer.log"
    with open(log, "w") as f:
        proc = tidal("grpo-infer", "--infer.port", str(port), "--infer.extra_args", '["--enable-scale-out"]',
                     stdout=f)
        try:
            wait_healthy(port, proc)
        except Exception:
            kill_group(proc)
            raise RuntimeError(log.read_text()[-3000:]) from None
        yield f"http://127.0.0.1:{port}/v1"
        kill_group(proc)


@pytest.fixture(scope="session")
def nccl_server(tmp_path_factory):
    """A second real vLLM server, without LoRA, open to weight pushes (`weight_broadcast_type: nccl`): yields
    (base URL, process, log path). Tests may change its weights."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm_push") / "infer.log"
    with open(log, "w") as f:
        proc = tidal("grpo-infer", "--infer.port", str(port), "--infer.weight_broadcast_type", "nccl",
                     "--infer.enable_lora", "false", stdout=f)
        try:
            wait_healthy(port, proc)
        except Exception:
            kill_group(proc)
            raise RuntimeError(log.read_text()[-3000:]) from None
        yield f"http://127.0.0.1:{port}/v1", proc, log
        kill_group(proc)
