"""Run model-written Python in a subprocess with time, memory and output limits and no network.

Rewards that execute code a model wrote (unit tests of a coding task, a calculator tool) must never run it
in the orchestrator. `run_python` starts `python -I` in a fresh temp directory with an empty environment and:
- time: a wall-clock timeout (the whole process group is killed) and RLIMIT_CPU;
- memory: RLIMIT_AS (address space), so an allocation beyond it fails with MemoryError;
- files: RLIMIT_FSIZE caps what it may write; RLIMIT_NOFILE caps open files;
- network: a new, empty network namespace (`unshare(CLONE_NEWNET)`, or with a user namespace when not
  privileged) so no interface but a down loopback exists; and in every case a Python audit hook (which the
  code cannot remove) refusing sockets, subprocesses, fork/exec, ctypes and signals to other processes.
Simplification: this is a resource and network jail, not a security boundary against a hostile kernel
exploit; run untrusted workloads on machines you can afford to lose, as with any RL code environment.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000

BOOTSTRAP = r"""
import sys
_BLOCKED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
            "os.forkpty", "ctypes.", "os.kill", "os.killpg", "pty.")
def _hook(event, args):
    if event.startswith(_BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.addaudithook(_hook)
sys.argv = ["solution.py"]
_src = open("solution.py").read()
exec(compile(_src, "solution.py", "exec"), {"__name__": "__main__"})
"""


@dataclass
class SandboxResult:
    """What the code did: exit status (None when killed for time), output, and how it was isolated."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    network: str
    """`namespace` (empty network namespace + audit hook) or `audit-hook` (audit hook only)."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _limits(timeout_s: float, memory_mb: int, file_mb: int, netns: list[str]) -> None:
    """Runs in the child between fork and exec."""
    import resource

    os.setsid()
    cpu = int(timeout_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.unshare(CLONE_NEWNET) == 0 or libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        netns.append("namespace")


def network_namespace_available() -> bool:
    """Whether this machine lets a child enter an empty network namespace."""
    r = run_python("print('x')", timeout_s=20)
    return r.network == "namespace"


def run_python(code: str, stdin: str = "", timeout_s: float = 10.0, memory_mb: int = 512,
               file_mb: int = 16, max_output: int = 1 << 16) -> SandboxResult:
    """Run `code` as a script in the sandbox; its stdout/stderr are returned (truncated to `max_output`)."""
    with tempfile.TemporaryDirectory(prefix="tidal-sandbox-") as tmp:
        Path(tmp, "solution.py").write_text(code)
        probe = Path(tmp, ".netns")

        def setup() -> None:
            netns: list[str] = []
            _limits(timeout_s, memory_mb, file_mb, netns)
            if netns:
                probe.write_text("1")

        proc = subprocess.Popen([sys.executable, "-I", "-c", BOOTSTRAP], cwd=tmp, env={"PATH": "/usr/bin:/bin"},
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=setup, text=True)
        timed_out = False
        try:
            out, err = proc.communicate(stdin, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        network = "namespace" if probe.exists() else "audit-hook"
    code_ = None if timed_out else proc.returncode
    return SandboxResult(code_, out[:max_output], err[:max_output], timed_out, network)
