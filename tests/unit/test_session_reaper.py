"""`tests/session_reaper.py`: a pytest killed outright leaves no process its tests started — a real inner pytest,
real signals."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tidal.procs.reaper import pid_alive

ROOT = Path(__file__).resolve().parents[2]

# A test that starts a server-like child in its own session (as the shared vLLM fixtures do), says its pid, and
# waits to be killed.
LEAKY_TEST = textwrap.dedent("""
    import subprocess, sys, time
    from pathlib import Path

    def test_leaves_a_server_behind():
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
        Path("child.pid").write_text(str(child.pid))
        time.sleep(120)
""")


def killed_inner_pytest(tmp_path: Path, plugin: list[str]) -> int:
    """Run the leaky test in an inner pytest, SIGKILL that pytest once the child is up; the child's pid."""
    (tmp_path / "test_leaky.py").write_text(LEAKY_TEST)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    inner = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin,
                              "test_leaky.py"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (tmp_path / "child.pid").exists():
        assert inner.poll() is None and time.monotonic() < deadline, "the inner pytest never started its child"
        time.sleep(0.1)
    child = int((tmp_path / "child.pid").read_text())
    time.sleep(1.5)  # the reaper has scanned the family at least once
    inner.send_signal(signal.SIGKILL)
    inner.wait()
    return child


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("with_plugin", [True, False], ids=["plugin", "without"])
def test_a_killed_pytest_leaves_nothing_running_with_the_plugin(tmp_path, with_plugin):
    child = killed_inner_pytest(tmp_path, ["-p", "tests.session_reaper"] if with_plugin else [])
    try:
        # Without the plugin the check can fail: the child runs on after pytest's death.
        assert gone_within(child, 10 if with_plugin else 3) is with_plugin
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
