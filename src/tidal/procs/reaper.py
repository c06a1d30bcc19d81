"""Nothing a tidal process started outlives it: a reaper process that kills the descendants of a dead process.

A process killed with SIGKILL (by hand, by the OOM killer) runs no cleanup, and its children are re-parented
instead of dying with it: vLLM's EngineCore and workers survive their API server, a co-locate launcher's
grandchildren survive it (its direct children get SIGKILL through PR_SET_PDEATHSIG, but not theirs). So the
processes that start others (`tidal grpo`, `tidal grpo-infer`, `tidal grpo-orch`) each start a reaper
(`start_reaper()`): a small separate process, in its own session so signals aimed at the watched process's group
do not reach it, that
- follows the watched process's descendants (a scan of /proc every `poll_s` seconds, remembering each pid with
  its start time, so a recycled pid is never mistaken for one of them), and
- when the watched process exits (a pidfd becomes readable; any exit, clean or not), sends SIGTERM to every
  remembered descendant still alive, waits up to `grace_s` seconds, then SIGKILLs what is left, and exits.
After a clean shutdown there is nothing left to kill and the reaper simply exits. Linux only (pidfd, /proc);
elsewhere `start_reaper` does nothing.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

POLL_S = 0.5
GRACE_S = 3.0


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, start time in clock ticks, state) of `pid` from /proc, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = raw[raw.rfind(")") + 2:].split()  # after the command name, which may hold spaces and ')'
    return int(fields[1]), int(fields[19]), fields[0]


def pid_alive(pid: int) -> bool:
    """`pid` is a live process (neither gone nor a zombie), read from /proc."""
    st = _stat(pid)
    return st is not None and st[2] != "Z"


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, start time) of every live process."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None and st[2] != "Z":
            table[int(entry)] = (st[0], st[1])
    return table


def descendants(table: dict[int, tuple[int, int]], root: int) -> dict[int, int]:
    """pid -> start time of every descendant of `root` in `table`."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out[pid] = table[pid][1]
        todo += children.get(pid, [])
    return out


def _alive(pid: int, started: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] == started and st[2] != "Z"


def kill_all(known: dict[int, int], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM the processes of `known` (pid -> start time) still alive, SIGKILL them after `grace_s`; returns
    the pids that had to be signalled."""
    targets = [pid for pid, started in known.items() if _alive(pid, started)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in targets:
            if _alive(pid, known[pid]):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline and any(_alive(p, known[p]) for p in targets):
            time.sleep(0.05)
    return targets


def watch(pid: int, poll_s: float = POLL_S, grace_s: float = GRACE_S) -> list[int]:
    """Follow `pid`'s descendants until it exits, then kill those still alive; returns the killed pids."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return []
    me = os.getpid()
    known: dict[int, int] = {}
    try:
        while not select.select([fd], [], [], poll_s)[0]:
            found = descendants(process_table(), pid)
            found.pop(me, None)
            known = {p: s for p, s in known.items() if _alive(p, s)} | found
    finally:
        os.close(fd)
    known.pop(me, None)
    return kill_all(known, grace_s)


def signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    """Send `sig` to the process group `proc` leads (gone or not ours: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


class Stoppable(Protocol):
    """A started component: something that signals its whole process group and whose `proc` can be waited for
    (`launcher.Child`, an in-process component, a dp server)."""

    proc: Any

    def signal_group(self, sig: int) -> None: ...


def stop_groups(items: Sequence[Stoppable], timeout_s: float) -> None:
    """Stop started components: SIGTERM every group, wait up to `timeout_s` in all, then SIGKILL what is left of
    each group (e.g. vLLM's engine processes) and reap the leaders."""
    for c in items:
        c.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for c in items:
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    for c in items:
        c.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(timeout=5)
    for c in items:  # a killed member (vLLM's engine core) is in the process table until reaped: wait it out
        if isinstance(pid := getattr(c.proc, "pid", None), int):
            wait_group_gone(pid, GROUP_GONE_S)


GROUP_GONE_S = 5.0
"""How long `stop_groups` waits for a SIGKILLed group's last members to be gone."""


def group_alive(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`, from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                raw = Path(f"/proc/{entry}/stat").read_text()
                fields = raw[raw.rfind(")") + 2:].split()
                if int(fields[3]) == pgid and fields[0] != "Z":
                    out.append(int(entry))
    return out


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait until process group `pgid` has no live process left (a zombie, dead but not yet reaped, counts as
    gone); False when some are left after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def start_reaper(pid: int | None = None) -> subprocess.Popen[bytes] | None:
    """Start a reaper for `pid` (default: this process); None where the platform has no pidfd or /proc."""
    if not hasattr(os, "pidfd_open") or not Path("/proc/self/stat").exists():
        return None
    return subprocess.Popen([sys.executable, "-c", REAPER_MAIN, str(pid or os.getpid())],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


REAPER_MAIN = "import sys; from tidal.procs.reaper import main; main(int(sys.argv[1]))"
"""The reaper process's program. Not `-m tidal.procs.reaper`: `tidal.procs` imports this module, and runpy would
run it a second time beside the imported copy (its RuntimeWarning on every start)."""


def main(pid: int) -> None:
    """The reaper process: watch `pid` until it exits, then stop what it started (Ctrl-C does not end the watch)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the watched process's exit ends the watch
    watch(pid)
