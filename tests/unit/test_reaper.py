"""`tidal.procs.reaper`: when a process dies without cleanup (SIGKILL), the processes it started die too — real
processes, real signals."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

from tidal.procs.reaper import _alive, _stat, descendants, kill_all, process_table

# A parent that starts a child, which starts a grandchild (all sleeping), optionally with a reaper; it prints
# the pids and waits to be killed.
FAMILY = textwrap.dedent("""
    import subprocess, sys, time
    from tidal.procs.reaper import start_reaper
    reaper = start_reaper() if sys.argv[1] == "reaper" else None
    child = subprocess.Popen([sys.executable, "-c",
        "import subprocess, sys, time; g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']);"
        "print(g.pid, flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    print(child.pid, grandchild, reaper.pid if reaper else 0, flush=True)
    time.sleep(120)
""")


def start_family(with_reaper: bool) -> tuple[subprocess.Popen[str], int, int, int]:
    parent = subprocess.Popen([sys.executable, "-c", FAMILY, "reaper" if with_reaper else "none"],
                              stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child, grandchild, reaper = (int(x) for x in parent.stdout.readline().split())
    time.sleep(1.5)  # the reaper has scanned the family at least once
    return parent, child, grandchild, reaper


def gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any((st := _stat(p)) is not None and st[2] != "Z" for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_sigkill_of_the_parent_takes_children_and_grandchildren_along():
    parent, child, grandchild, reaper = start_family(with_reaper=True)
    assert reaper and _stat(reaper) is not None
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert gone_within([child, grandchild], 10), "the reaper did not kill the orphans"
    assert gone_within([reaper], 5), "the reaper exits after its work"


def test_without_a_reaper_the_orphans_survive():
    """The check above can fail: a SIGKILLed parent leaves its family running on its own."""
    parent, child, grandchild, _ = start_family(with_reaper=False)
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert not gone_within([child, grandchild], 2)
    finally:
        for pid in (child, grandchild):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period():
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"],
                                stdout=subprocess.PIPE)
    assert stubborn.stdout is not None and stubborn.stdout.readline()
    st = _stat(stubborn.pid)
    assert st is not None
    t0 = time.monotonic()
    assert kill_all({stubborn.pid: st[1]}, grace_s=0.5) == [stubborn.pid]
    assert stubborn.wait(timeout=5) == -signal.SIGKILL and time.monotonic() - t0 >= 0.5


def test_a_recycled_pid_is_never_taken_for_a_remembered_process():
    st = _stat(os.getpid())
    assert st is not None and _alive(os.getpid(), st[1])
    assert not _alive(os.getpid(), st[1] + 1), "same pid, other start time: another process"
    assert kill_all({os.getpid(): st[1] + 1}) == []


def test_descendants_follow_the_process_tree():
    table = {10: (1, 5), 11: (10, 6), 12: (11, 7), 13: (1, 8)}
    assert descendants(table, 10) == {11: 6, 12: 7}
    assert os.getpid() in process_table()


def test_stop_groups_returns_once_every_member_of_the_group_is_gone():
    """`stop_groups` (the launcher's stop) returns only when no live process of a child's group is left, the
    members the leader started included (vLLM's engine core beside its API server)."""
    from tidal.procs.reaper import group_alive, stop_groups

    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "m = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
                               "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']); "
                               "print(m.pid, flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert leader.stdout is not None
    member = int(leader.stdout.readline())
    assert sorted(group_alive(leader.pid)) == sorted([leader.pid, member])

    class Item:
        proc = leader

        def signal_group(self, sig: int) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(leader.pid, sig)

    stop_groups([Item()], timeout_s=0.5)
    assert group_alive(leader.pid) == []
