"""One harness for the benches (bench/) and the GPU checks (scripts/): their children through `tidal.procs`.

Every process a bench or a check starts is a `tidal.procs.Child` (its own process group, SIGKILL when this process
dies, its output pumped to a log): `start` one, `run` one to its end or its budget (then its whole group is
stopped), `wait_ready` until its health URL answers (`tidal.procs.wait_healthy`: a child that exits first or a
budget that runs out raises `NotHealthy`, never a silent pass), `stop` any number as whole groups, `free_port` for
its port. `child_env` is the environment they share: tidal's `src` first on PYTHONPATH, plain logs, no Hub access.

Standard library and `tidal.procs` only (torch-free): it runs with the GPU kit's python3, without .venv. Import it
after putting `scripts/` on `sys.path` (`sys.path.insert(0, str(REPO / "scripts"))`); it puts `src/` there itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

from tidal import procs  # noqa: E402 - after the path
from tidal.procs import Child, NotHealthy, free_port  # noqa: E402

__all__ = ["REPO", "Child", "NotHealthy", "child_env", "free_port", "last_json", "run", "run_json", "start", "stop",
           "wait_ready"]


def child_env(*extra_path: str | Path, **extra: str) -> dict[str, str]:
    """This process's environment for a child: `extra_path` then tidal's `src` first on PYTHONPATH, TIDAL_PLAIN=1
    (plain log lines), HF_HUB_OFFLINE=1 (nothing downloaded), PYTHONUNBUFFERED=1, plus `extra`."""
    path = [*(str(p) for p in extra_path), str(REPO / "src"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "TIDAL_PLAIN": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join(p for p in path if p), **extra}


def start(name: str, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None,
          cwd: Path = REPO, echo: bool = False, on_line: Callable[[str], None] | None = None) -> Child:
    """`argv` as a `Child` named `name` in `cwd`, its output to `log` (truncated first) and to `on_line` line by
    line, environment `env` (default `child_env()`)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"")
    return Child(name, [str(a) for a in argv], log_path=log, echo=echo, env=env or child_env(), cwd=cwd,
                 on_line=on_line)


def stop(*children: Child) -> None:
    """Stop each child's whole process group (SIGTERM, a grace period, SIGKILL: `tidal.procs.stop`)."""
    procs.stop([c for c in children if c is not None])


def run(argv: Sequence[str], log: Path, budget_s: float, env: Mapping[str, str] | None = None, cwd: Path = REPO,
        name: str = "run") -> tuple[int | None, str]:
    """`argv` to its end or for at most `budget_s` seconds, then its whole group stopped. Returns (exit code, or
    None when it was stopped at its budget; the log's text)."""
    child = start(name, argv, log, env, cwd)
    try:
        code: int | None = child.wait(timeout=max(0.1, budget_s))
    except subprocess.TimeoutExpired:
        code = None
    finally:
        stop(child)
    child.tail()  # waits for the output pump to reach the end of the log
    return code, log.read_text(errors="replace")


def last_json(text: str) -> dict[str, Any] | None:
    """The last line of `text` that is a JSON object (a child's result printed after its log lines; stderr may
    follow it in a merged log), or None."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None


def run_json(argv: Sequence[str], budget_s: float, env: Mapping[str, str] | None = None,
             what: str = "child") -> dict[str, Any]:
    """`run` a child that prints its result as a JSON object line; the object, or RuntimeError naming `what`, the
    exit and the log's tail (the log in a temp directory, kept on failure)."""
    log = Path(tempfile.mkdtemp(prefix="tidal-child-")) / "child.log"
    code, text = run(argv, log, budget_s, env=env, name=what.split()[0])
    result = last_json(text) if code == 0 else None
    if result is None:
        why = f"stopped after {budget_s:.0f} s" if code is None else f"exit {code}"
        raise RuntimeError(f"{what} failed ({why}; log {log}):\n{text[-3000:]}")
    shutil.rmtree(log.parent, ignore_errors=True)
    return result


def wait_ready(child: Child | None, url: str, budget_s: float, started: float | None = None,
               poll_s: float = 0.5) -> float:
    """Until `url` answers 200, for at most `budget_s` seconds counted from `started` (default now): a fixed
    limit, not a shrinking time left), asked every `poll_s`. Returns the seconds since `started`; `NotHealthy`
    when `child` exits first or the budget runs out."""
    started = time.monotonic() if started is None else started
    procs.wait_healthy(url, child, max(0.1, budget_s - (time.monotonic() - started)), poll_s=poll_s)
    return time.monotonic() - started
