"""`tidal.procs.exit.fast_exit` skips only the interpreter's teardown: a non-daemon thread still finishes, atexit
handlers and logging's flush run, unflushed stdout arrives, and the exit code is the one given; the `tidal` entry
ends `FAST_EXIT` commands through it (unless `TIDAL_FAST_EXIT=0`) and the others as before."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tidal.cli import FAST_EXIT

PROGRAM = textwrap.dedent("""
    import atexit, logging, sys, threading, time
    from pathlib import Path
    out = Path(sys.argv[1])
    logging.basicConfig(filename=out / "log.txt", level=logging.INFO)
    atexit.register(lambda: (out / "atexit.txt").write_text("ran"))
    def late():
        time.sleep(0.5)
        (out / "thread.txt").write_text("done")
    threading.Thread(target=late).start()
    logging.getLogger("x").info("a logged line")
    sys.stdout.write("no newline, not flushed")
    from tidal.procs.exit import fast_exit
    fast_exit(3)
    (out / "after.txt").write_text("never")
""")


def test_fast_exit_keeps_threads_atexit_logging_and_output(tmp_path):
    proc = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "no newline, not flushed"
    assert (tmp_path / "thread.txt").read_text() == "done", "a non-daemon thread is joined first"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert "a logged line" in (tmp_path / "log.txt").read_text()
    assert not (tmp_path / "after.txt").exists()


def test_the_entry_fast_exits_the_run_commands_only():
    assert FAST_EXIT == {"grpo", "grpo-train", "grpo-orch"}
    code = ("import sys, tidal.procs.exit as e, tidal.cli as c; "
            "e.fast_exit = lambda code: (print('fast', code), sys.stdout.flush(), e.os._exit(code)); "
            "c.main = lambda: 5; sys.argv = ['tidal', sys.argv[1]]; c.entry()")
    env = {k: v for k, v in os.environ.items() if k != "TIDAL_FAST_EXIT"}
    for command, fast, off in (("grpo-train", True, False), ("grpo", True, False), ("grpo-orch", False, True),
                               ("export", False, False), ("eval", False, False)):
        proc = subprocess.run([sys.executable, "-c", code, command], capture_output=True, text=True, timeout=60,
                              env={**env, "TIDAL_FAST_EXIT": "0"} if off else env)
        assert proc.returncode == 5, proc.stderr
        assert (proc.stdout.strip() == "fast 5") is fast, (command, proc.stdout)
