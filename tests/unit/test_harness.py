"""The one harness of the benches and GPU checks (scripts/harness.py, on `tidal.procs`), with real processes: a child
stopped at its budget takes its whole process group with it, a health wait ends at a real HTTP server or raises when
the child exits first, and no bench or script starts, waits for or kills children by hand any more.
"""

from __future__ import annotations

import ast
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import harness  # noqa: E402

TOOLS = sorted([*REPO.glob("bench/*.py"), *REPO.glob("scripts/*.py")])


def test_run_returns_the_exit_code_and_the_output(tmp_path):
    code, text = harness.run([sys.executable, "-c", "import sys; print('hello'); sys.exit(3)"], tmp_path / "a.log", 30)
    assert code == 3 and text.strip() == "hello" and (tmp_path / "a.log").read_text().strip() == "hello"


def test_run_json_reads_the_result_line_past_later_stderr():
    script = ("import json, sys; print('log line'); print(json.dumps({'tokens_per_s': 12.5})); "
              "print('a late warning', file=sys.stderr)")
    assert harness.run_json([sys.executable, "-c", script], 30) == {"tokens_per_s": 12.5}
    with pytest.raises(RuntimeError, match=r"(?s)the row failed \(exit 3; log .*boom"):
        harness.run_json([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], 30, what="the row")
    with pytest.raises(RuntimeError, match="no result failed"):
        harness.run_json([sys.executable, "-c", "print('[1, 2]')"], 30, what="no result")
    assert harness.last_json('{"a": 1}\n{broken\n[3]\n') == {"a": 1} and harness.last_json("x") is None


def test_children_run_in_the_directory_asked_for(tmp_path):
    (tmp_path / "here").mkdir()
    code, text = harness.run([sys.executable, "-c", "import os; print(os.getcwd())"], tmp_path / "c.log", 30,
                             cwd=tmp_path / "here")
    assert code == 0 and text.strip() == str(tmp_path / "here")
    code, text = harness.run([sys.executable, "-c", "import os; print(os.getcwd())"], tmp_path / "d.log", 30)
    assert text.strip() == str(REPO)


def test_run_stops_the_whole_group_at_its_budget(tmp_path):
    pid_file = tmp_path / "grandchild"
    script = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(120)']); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    started = time.monotonic()
    code, _ = harness.run([sys.executable, "-c", script], tmp_path / "b.log", 3)
    assert code is None and time.monotonic() - started < 40
    grandchild = int(pid_file.read_text())
    end = time.monotonic() + 10
    while Path(f"/proc/{grandchild}").exists() and time.monotonic() < end:
        time.sleep(0.2)
    assert not Path(f"/proc/{grandchild}").exists()


def test_wait_ready_meets_a_real_server_and_raises_when_the_child_exits(tmp_path):
    port = harness.free_port()
    server = harness.start("http", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                           tmp_path / "http.log", cwd=tmp_path)
    try:
        assert harness.wait_ready(server, f"http://127.0.0.1:{port}/", 60, poll_s=0.1) < 60
    finally:
        harness.stop(server)
    dead = harness.start("dies", [sys.executable, "-c", "raise SystemExit(7)"], tmp_path / "dies.log")
    with pytest.raises(harness.NotHealthy, match="exited with code 7"):
        harness.wait_ready(dead, f"http://127.0.0.1:{harness.free_port()}/health", 60, poll_s=0.1)


def test_child_env_puts_tidal_first_and_keeps_the_hub_offline():
    env = harness.child_env("/extra")
    assert env["PYTHONPATH"].split(":")[:2] == ["/extra", str(REPO / "src")]
    assert env["HF_HUB_OFFLINE"] == "1" and env["TIDAL_PLAIN"] == "1"


def calls(tree: ast.AST) -> set[str]:
    """Dotted names called in `tree` (`subprocess.Popen`, `os.killpg`)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value,
                                                                                              ast.Name):
            out.add(f"{node.func.value.id}.{node.func.attr}")
    return out


@pytest.mark.parametrize("path", TOOLS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_benches_and_scripts_stand_on_the_harness(path):
    if path.name == "harness.py":
        return
    tree = ast.parse(path.read_text())
    assert not {"subprocess.Popen", "os.killpg"} & calls(tree), "start and stop children with scripts/harness.py"
    defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert not {"free_port", "kill_group", "wait_healthy", "wait_ready"} & defined, "the harness has these"
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "tests.conftest" not in imported, "benches do not import the test suite's fixtures"
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)], "no module-global callbacks (issue 48)"
