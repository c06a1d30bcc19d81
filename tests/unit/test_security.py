"""Security rules: loopback by default, no non-loopback bind without an API key, no pickle anywhere, and
model-written code only in the sandbox (time, memory, no network)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tidal.config.infer import InferConfig
from tidal.inference.backends.bind import InsecureBindError, check_bind_secure
from tidal.inference.backends.vllm.server import vllm_argv
from tidal.rewards.code_exec import unit_tests
from tidal.rewards.sandbox import network_namespace_available, run_python

SRC = Path(__file__).resolve().parents[2] / "src" / "tidal"


def test_servers_bind_to_localhost_by_default():
    argv = vllm_argv(InferConfig(model="tidal:tiny-reverse"))
    assert argv[argv.index("--host") + 1] == "127.0.0.1"


def test_binding_beyond_localhost_needs_an_api_key(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    check_bind_secure(InferConfig(model="m"))
    check_bind_secure(InferConfig(model="m", host="::1"))
    with pytest.raises(InsecureBindError, match="0.0.0.0.*without an API key.*VLLM_API_KEY"):
        check_bind_secure(InferConfig(model="m", host="0.0.0.0"))
    check_bind_secure(InferConfig(model="m", host="0.0.0.0", extra_args=["--api-key", "k"]))
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    check_bind_secure(InferConfig(model="m", host="0.0.0.0"))


def test_nccl_weight_broadcast_opens_the_weight_transfer_routes_only_when_asked(monkeypatch):
    import json

    from tidal.inference.backends.vllm.server import vllm_env

    plain = InferConfig(model="tidal:tiny-reverse")
    assert "--weight-transfer-config" not in vllm_argv(plain) and "VLLM_SERVER_DEV_MODE" not in vllm_env(plain)
    nccl = InferConfig(model="tidal:tiny-reverse", weight_broadcast_type="nccl")
    argv = vllm_argv(nccl)
    assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {"backend": "tidal_gloo"}  # CPU here
    assert vllm_env(nccl)["VLLM_SERVER_DEV_MODE"] == "1"
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(InsecureBindError, match="nccl weight broadcasts"):
        check_bind_secure(InferConfig(model="m", host="0.0.0.0", weight_broadcast_type="nccl"))


@pytest.mark.parametrize("command", [["grpo-infer"], ["grpo"]])
def test_cli_refuses_an_open_bind_without_a_key_with_exit_2(command):
    env = {k: v for k, v in __import__("os").environ.items() if k != "VLLM_API_KEY"}
    r = subprocess.run([sys.executable, "-m", "tidal.cli", *command, "--infer.host", "0.0.0.0"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "refusing to serve beyond localhost without an API key" in r.stderr


def test_no_pickle_in_any_reader_or_writer():
    """Nothing in tidal deserializes pickle: no pickle/marshal/shelve/dill imports, no torch.load, no
    np.load with allow_pickle."""
    bad = re.compile(r"^\s*(import|from)\s+(pickle|cPickle|marshal|shelve|dill|cloudpickle)\b|torch\.load\(|"
                     r"allow_pickle\s*=\s*True|pd\.read_pickle", re.M)
    hits = [f"{p.relative_to(SRC)}: {m.group(0).strip()}" for p in SRC.rglob("*.py")
            for m in bad.finditer(p.read_text())]
    assert not hits, hits


def test_sandbox_runs_code_and_returns_its_output():
    r = run_python("import sys; print(sum(range(10))); print('err', file=sys.stderr)")
    assert r.ok and r.stdout == "45\n" and r.stderr == "err\n"
    assert run_python("raise SystemExit(3)").returncode == 3


def test_sandbox_enforces_time_limit():
    t0 = time.monotonic()
    r = run_python("while True: pass", timeout_s=1.5)
    assert r.timed_out and not r.ok and r.returncode is None
    assert time.monotonic() - t0 < 10


def test_sandbox_enforces_memory_limit():
    r = run_python("x = bytearray(800 * 2**20); print('allocated')", memory_mb=256)
    assert not r.ok and "MemoryError" in r.stderr and "allocated" not in r.stdout
    assert run_python("x = bytearray(20 * 2**20); print('ok')", memory_mb=256).ok


def test_sandbox_has_no_network():
    with socket.socket() as server:  # a real listener on this machine's loopback
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        r = run_python(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('in')")
    assert not r.ok and "in" not in r.stdout
    for escape in ("import subprocess; subprocess.run(['true'])", "import os; os.system('true')",
                   "import ctypes", "import os; os.fork()"):
        r = run_python(escape)
        assert not r.ok and "sandbox:" in r.stderr, escape


def test_network_namespace_isolation_when_the_kernel_allows_it():
    if not network_namespace_available():
        pytest.skip("this machine refuses unshare(CLONE_NEWNET); the audit hook alone blocks sockets here")
    # below the audit hook: the namespace has no usable interface at all
    r = run_python("import fcntl, struct\nwith open('/proc/net/dev') as f: print(f.read())")
    assert r.ok, r.stderr
    interfaces = [line.split(":")[0].strip() for line in r.stdout.splitlines()[2:] if ":" in line]
    assert interfaces == ["lo"], interfaces


def test_code_reward_runs_tests_in_the_sandbox():
    good = [{"role": "assistant", "content": "```python\ndef add(a, b):\n    return a + b\n```"}]
    bad = [{"role": "assistant", "content": "def add(a, b):\n    return a - b"}]
    hostile = [{"role": "assistant", "content": "import socket\nsocket.create_connection(('1.1.1.1', 80))\n"
                                               "def add(a, b): return a + b"}]
    loop = [{"role": "assistant", "content": "while True: pass"}]
    tests = "assert add(2, 3) == 5"
    out = unit_tests([good, bad, hostile, loop, good], tests=[tests, tests, tests, tests, None], timeout_s=2)
    assert out == [1.0, 0.0, 0.0, 0.0, None]


def test_gloo_weight_broadcast_rendezvous_listens_on_its_host_only():
    """The trainer's rendezvous store (rank 0) must not listen on every interface (TCPStore's default)."""
    import datetime

    import psutil
    import torch.distributed as dist

    from tests.conftest import free_port
    from tidal.inference.backends.vllm.weight_transfer import GlooGroup

    port = free_port()
    group = GlooGroup("127.0.0.1", port, 0, 1, timeout_s=5)  # a one-rank group needs no peers
    listening = [c.laddr for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port]
    assert [a.ip for a in listening] == ["127.0.0.1"], listening
    client = dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=datetime.timedelta(seconds=5))
    client.set("k", b"v")
    assert group.store.get("k") == b"v"
    group.destroy()
