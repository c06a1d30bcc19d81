"""`tidal.procs`, the one home of tidal's child processes: real processes, real signals, a real HTTP server; and an
AST scan that keeps every long-lived child (and every free-port pick) there."""

from __future__ import annotations

import ast
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import REPO
from tidal.procs import Child, NotHealthy, PortInUseError, check_port_free, free_port, stop, wait_healthy
from tidal.procs.reaper import _stat, group_alive

SRC = REPO / "src" / "tidal"
HOME = {"tidal/procs/__init__.py", "tidal/procs/reaper.py"}
ALLOWED_POPEN = {
    "tidal/rewards/sandbox.py": "one-shot run of untrusted code (communicate with a timeout, rlimits set in "
                                "preexec_fn); it ends before run_python returns, it is no server",
}
"""Modules besides `HOME` that may call subprocess.Popen, and why. A list that must not grow."""


RUNNERS = ("run", "call", "check_call", "check_output", "getoutput", "getstatusoutput")
"""`subprocess` functions that start a child outside `tidal.procs` (no parent-death signal, no own group)."""


def _calls_popen(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == "Popen") or (isinstance(f, ast.Name) and f.id == "Popen"):
                return True
    return False


def _runs_subprocess(tree: ast.AST) -> bool:
    """`subprocess.run(...)` and its kin (`RUNNERS`), called through the module or imported from it."""
    imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "subprocess"
                for a in n.names if a.name in RUNNERS}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr in RUNNERS and isinstance(f.value, ast.Name)
                    and f.value.id == "subprocess") or (isinstance(f, ast.Name) and f.id in imported):
                return True
    return False


def _modules() -> dict[str, ast.AST]:
    return {p.relative_to(SRC.parent).as_posix(): ast.parse(p.read_text(), str(p)) for p in sorted(SRC.rglob("*.py"))}


def test_only_procs_and_the_reaper_start_child_processes():
    modules = _modules()
    assert "tidal/procs/__init__.py" in modules and "tidal/inference/backends/dp.py" in modules
    popen = {name for name, tree in modules.items() if _calls_popen(tree)}
    assert popen - HOME - set(ALLOWED_POPEN) == set(), "start long-lived children with tidal.procs.Child"
    assert set(ALLOWED_POPEN) <= popen, "an allow-listed module no longer calls Popen: shorten ALLOWED_POPEN"
    assert "tidal/procs/__init__.py" in popen


def test_free_ports_and_the_parent_death_signal_live_in_procs_only():
    for name, tree in _modules().items():
        defs = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        prctl = any(isinstance(n, ast.Attribute) and n.attr == "prctl" for n in ast.walk(tree))
        if name != "tidal/procs/__init__.py":
            assert "free_port" not in defs, f"{name} defines free_port: use tidal.procs.free_port"
            assert "_die_with_parent" not in defs and not prctl, f"{name} sets a parent-death signal itself"


def _readline(child: Child, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while not (line := child.tail(1)):
        assert time.monotonic() < deadline, "the child printed nothing"
        time.sleep(0.05)
    return line


def _gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        st = _stat(pid)
        if st is None or st[2] == "Z":
            return True
        time.sleep(0.05)
    return False


def test_a_child_leads_its_own_process_group_and_session():
    child = Child("pg", [sys.executable, "-c", "import os, time; print(os.getpgid(0), os.getsid(0), flush=True); "
                                               "time.sleep(60)"])
    try:
        pgid, sid = (int(x) for x in _readline(child).split())
        assert pgid == sid == child.pid != os.getpgid(0)
    finally:
        child.stop(5)
    assert child.poll() is not None


def test_a_child_dies_when_its_parent_is_sigkilled():
    # a real intermediate process starts a child with procs (no reaper), prints its pid and waits to be killed
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from tidal.procs import Child
        c = Child("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"])
        print(c.pid, flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert parent.stdout is not None
    grandchild = int(parent.stdout.readline())
    assert _stat(grandchild) is not None and _stat(grandchild)[0] == parent.pid  # type: ignore[index]
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    assert _gone(grandchild, 10), "the child outlived its SIGKILLed parent (PR_SET_PDEATHSIG)"


def test_the_health_wait_returns_once_a_real_server_answers(tmp_path):
    port = free_port()
    server = Child("http", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                            "--directory", str(tmp_path)])
    try:
        waited = wait_healthy(f"http://127.0.0.1:{port}/", server, timeout_s=60)
        assert 0.0 <= waited < 60
        assert server.poll() is None
    finally:
        server.stop(5)


def test_the_health_wait_names_the_url_when_the_child_exits_first():
    url = f"http://127.0.0.1:{free_port()}/health"
    child = Child("dies", [sys.executable, "-c", "import sys, time; time.sleep(0.3); sys.exit(3)"])
    exited = rf"the process serving {re.escape(url)} exited with code 3 after .* s"
    with pytest.raises(NotHealthy, match=exited) as info:
        wait_healthy(url, child, timeout_s=60)
    assert info.value.code == 3 and info.value.waiting == [url] and "ConnectError" in info.value.last


def test_the_health_wait_names_the_url_and_time_on_timeout_and_a_check_can_end_it():
    url = f"http://127.0.0.1:{free_port()}/health"
    child = Child("sleeps", [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(NotHealthy, match=rf"{re.escape(url)} did not answer 200 within 1 s") as info:
            wait_healthy(url, child, timeout_s=1.0)
        assert info.value.code is None
        with pytest.raises(KeyError, match="beside"):
            wait_healthy(url, child, timeout_s=60, check=lambda: (_ for _ in ()).throw(KeyError("beside")))
    finally:
        child.stop(5)


def test_stop_kills_the_whole_group_even_a_grandchild_that_ignores_sigterm():
    code = textwrap.dedent("""
        import signal, subprocess, sys, time
        g = subprocess.Popen([sys.executable, "-c",
                              "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
        print(g.pid, flush=True)
        time.sleep(120)
    """)
    child = Child("family", [sys.executable, "-c", code])
    grandchild = int(_readline(child))
    assert child.pid in group_alive(child.pid) and grandchild in group_alive(child.pid)
    started = time.monotonic()
    stop([child], timeout_s=1.0)
    assert child.poll() is not None and _gone(grandchild, 1), "stop left a member of the group alive"
    assert group_alive(child.pid) == [] and time.monotonic() - started < 15


def test_tail_log_echo_and_on_line(tmp_path, capfd):
    log, seen = tmp_path / "logs" / "x.log", []
    first = Child("x", [sys.executable, "-c", "print('first run')"], log_path=log)
    assert first.wait(timeout=30) == 0
    assert first.tail() == "first run"
    second = Child("x", [sys.executable, "-c", "import os; print('second', os.environ['TIDAL_T'], "
                                               "os.environ['PYTHONUNBUFFERED']); print('more')"],
                   log_path=log, echo=True, on_line=seen.append, env={"TIDAL_T": "set"})
    assert second.wait(timeout=30) == 0
    assert second.tail() == "second set 1\nmore" and second.tail(1) == "more", "only this process's lines"
    assert log.read_text() == "first run\nsecond set 1\nmore\n", "the log keeps both runs"
    assert seen == ["second set 1\n", "more\n"]
    assert "[x] second set 1\n[x] more\n" in capfd.readouterr().out
    assert "TIDAL_T" not in os.environ


def test_free_port_is_bindable_and_a_taken_port_is_refused():
    port = free_port()
    check_port_free("127.0.0.1", port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        with pytest.raises(PortInUseError, match=f"127.0.0.1:{port}.*--infer.port"):
            check_port_free("127.0.0.1", port)


def test_procs_imports_no_torch_nor_tidal_beyond_the_reaper():
    code = ("import sys, tidal.procs; bad = {'torch', 'httpx'} & set(sys.modules); assert not bad, bad; "
            "mine = {m for m in sys.modules if m.startswith('tidal.')}; "
            "assert mine <= {'tidal.procs', 'tidal.procs.reaper'}, mine")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert r.returncode == 0, r.stderr


def test_short_children_go_through_procs_too():
    """`subprocess.run` and its kin start a child without the parent-death signal: outside `HOME` a short child
    (the GPU calibration step, the torchvision probe, nvidia-smi) goes through `tidal.procs.run`."""
    runs = {name for name, tree in _modules().items() if _runs_subprocess(tree)}
    assert runs - HOME == set(), "run short children with tidal.procs.run"
    assert _runs_subprocess(ast.parse("import subprocess\nsubprocess.check_output(['true'])"))
    assert _runs_subprocess(ast.parse("from subprocess import run as go\ngo(['true'])"))
    assert not _runs_subprocess(ast.parse("from tidal import procs\nprocs.run(['true'], 1)"))


def test_a_short_child_gets_its_group_and_the_parent_death_signal(tmp_path):
    """`procs.run`: the child leads its own session with SIGKILL as its parent-death signal (prctl's
    PR_GET_PDEATHSIG, read in the child); at the timeout its whole group, a grandchild included, is killed."""
    from tidal import procs

    probe = ("import ctypes, os; s = ctypes.c_int(); ctypes.CDLL('libc.so.6').prctl(2, ctypes.byref(s)); "
             "print(s.value, os.getsid(0) == os.getpid())")
    done = procs.run([sys.executable, "-c", probe], 30)
    assert (done.returncode, done.stdout.split()) == (0, [str(int(signal.SIGKILL)), "True"]), done.stderr
    pid_file = tmp_path / "grandchild"
    tree = (f"import subprocess, sys, time; g = subprocess.Popen([sys.executable, '-c', 'import time; "
            f"time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(g.pid)); time.sleep(60)")
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        procs.run([sys.executable, "-c", tree], 3)
    assert time.monotonic() - start < 20
    grandchild = int(pid_file.read_text())
    for _ in range(100):
        st = _stat(grandchild)
        if st is None or st[2] == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail("the grandchild outlived the timeout")
