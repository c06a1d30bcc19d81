"""Child processes: start one, wait until it answers, stop it; free ports and the checks of a server's address.

Every long-lived process tidal starts (the co-locate components, vLLM and SGLang servers, the Tinker server's vLLM,
OpenEnv apps, environment servers) is a `Child`:
- it leads its own session and process group, so `signal_group` and `stop` reach everything it starts (vLLM's
  engine core and workers), and a Ctrl-C aimed at the terminal's group does not reach it directly;
- it gets SIGKILL when its parent dies (PR_SET_PDEATHSIG, Linux). The "parent" is the *thread* that started it:
  start a child from a thread that lives as long as the child should (the main thread, an asyncio loop's thread).
  Its own children are not covered; the reaper (`tidal.procs.reaper`) kills those when a launcher is killed outright;
- its environment is this process's plus `env`, with PYTHONUNBUFFERED=1 (a Python child's lines arrive as written);
  it runs in `cwd` (default: this process's directory);
- its output (stdout and stderr, merged) is read line by line by a thread that appends each line to `log_path`
  (opened for appending: a restarted child continues its predecessor's log), echoes it to stdout behind a
  `[name] ` prefix (`echo`), hands it to `on_line`, and keeps the last `TAIL_LINES` for `tail`: this process's
  lines only, whoever else wrote the same log.
`run` is the short-lived kind (a probe, a calibration step): the same session and parent-death signal, run to its
end with a timeout. `wait_healthy` polls health URLs until each answers 200 and raises `NotHealthy` (naming the URLs
and the time) when the child exits first or time runs out; `stop` stops children as whole groups
(`tidal.procs.reaper.stop_groups`: SIGTERM, a grace period, SIGKILL). `free_port` picks a free localhost port.
`bind_host` and `check_port_free` are the checks a server's address gets before anything starts (a taken port; the
engines' API-key rule is `tidal.inference.backends.bind`).

The lowest layer: torch-free, imports nothing of tidal but the reaper (httpx only inside the health checks).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from tidal.procs.reaper import Stoppable, signal_group, stop_groups

TAIL_LINES = 2000
"""How many of its last output lines a `Child` keeps for `tail`."""
STOP_TIMEOUT_S = 20.0
HEALTH_POLL_S = 0.1
"""How often `wait_healthy` asks (a local GET costs well under 1 ms; a long interval only delays the waiter)."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _echo(prefix: bytes, raw: bytes) -> None:
    """Write one child line to stdout behind `prefix` (bytes: a line that is not valid text still goes out as is)."""
    buffer = getattr(sys.stdout, "buffer", None)
    if buffer is None:  # stdout replaced by a text-only stream
        sys.stdout.write((prefix + raw).decode(errors="replace"))
    else:
        sys.stdout.flush()
        buffer.write(prefix + raw)
        buffer.flush()
    sys.stdout.flush()


class Child:
    """One child process `argv`, named `name` (its echo prefix `[name] `), with its output pump (see the module)."""

    def __init__(self, name: str, argv: Sequence[str], *, log_path: Path | None = None, echo: bool = False,
                 on_line: Callable[[str], None] | None = None, env: Mapping[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.name, self.log_path, self.on_line = name, log_path, on_line
        self._echo = f"[{name}] ".encode() if echo else None
        self._lines: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._lock = threading.Lock()
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent, cwd=cwd,
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})
        self._pump = threading.Thread(target=self._copy, daemon=True, name=f"tidal-{name}-output")
        self._pump.start()

    def _copy(self) -> None:
        """Read the child's output until it closes; nothing here may stop reading (a full pipe blocks the child)."""
        assert self.proc.stdout is not None
        log = open(self.log_path, "ab") if self.log_path is not None else None  # noqa: SIM115 - closed below
        try:
            for raw in self.proc.stdout:
                if log is not None:
                    with contextlib.suppress(OSError):
                        log.write(raw)
                        log.flush()
                line = raw.decode(errors="replace")
                with self._lock:
                    self._lines.append(line)
                if self.on_line is not None:
                    with contextlib.suppress(Exception):  # a timing aid or a display must never stop the log
                        self.on_line(line)
                if self._echo is not None:
                    with contextlib.suppress(Exception):
                        _echo(self._echo, raw)
        finally:
            if log is not None:
                log.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def signal_group(self, sig: int) -> None:
        """Send `sig` to the child's whole process group."""
        signal_group(self.proc, sig)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop the child's whole group (`stop`)."""
        stop([self], timeout_s)

    def tail(self, lines: int = 25) -> str:
        """The last `lines` lines this process wrote (up to `TAIL_LINES`; not those of an earlier process that wrote
        the same log). After the child exited, its last lines are waited for (up to 2 s)."""
        if self.proc.poll() is not None:
            self._pump.join(timeout=2)
        with self._lock:
            text = "".join(self._lines)
        return "\n".join(text.splitlines()[-lines:])


def run(argv: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None,
        ) -> subprocess.CompletedProcess[str]:
    """A short child run to its end, its output (stdout, stderr) captured as text: like `subprocess.run`, but in its
    own session and process group with the parent-death signal (`Child`'s guarantees), and its whole group killed
    when it outlives `timeout_s` (then `subprocess.TimeoutExpired` is raised, as `subprocess.run` does). `env` is
    added to this process's environment. OSError when it cannot start."""
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=_die_with_parent,
                            env={**os.environ, **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        signal_group(proc, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)


def stop(children: Sequence[Stoppable], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM every child's process group, wait up to `timeout_s` in all, then SIGKILL what is left of each group
    (`tidal.procs.reaper.stop_groups`)."""
    stop_groups(children, timeout_s)


class Running(Protocol):
    """What a health wait watches: something that has exited (an exit code) or not (None)."""

    def poll(self) -> int | None: ...


class NotHealthy(RuntimeError):
    """A health wait ended without every URL answering 200: the child exited (`code`) or time ran out (`code`
    None). `waiting`: the URLs that had not answered; `waited_s`: how long it waited; `last`: the last answer."""

    def __init__(self, waiting: Sequence[str], waited_s: float, code: int | None, last: str) -> None:
        self.waiting, self.waited_s, self.code, self.last = list(waiting), waited_s, code, last
        urls = ", ".join(self.waiting)
        what = (f"the process serving {urls} exited with code {code} after {waited_s:.1f} s, before it answered"
                if code is not None else f"{urls} did not answer 200 within {waited_s:.0f} s")
        super().__init__(f"{what} (last: {last})")


def probe(url: str, timeout_s: float = 2.0) -> str | None:
    """GET `url`: None when it answers 200, else what it did instead (`HTTP 503`, `ConnectError: ...`)."""
    import httpx

    try:
        code = httpx.get(url, timeout=timeout_s).status_code
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if code == 200 else f"HTTP {code}"


def wait_healthy(urls: str | Sequence[str], child: Running | None, timeout_s: float, *,
                 poll_s: float = HEALTH_POLL_S, get_timeout_s: float = 2.0,
                 check: Callable[[], None] | None = None) -> float:
    """Wait until every URL of `urls` answers 200; returns the seconds waited. Each round first asks whether `child`
    (the process serving them; None: a server started elsewhere) has exited, then calls `check` (it may raise to end
    the wait, e.g. when a component started beside the server failed), then asks the URLs not yet answered.
    Raises `NotHealthy` when `child` exits first or after `timeout_s`."""
    start, waiting, last = time.monotonic(), [urls] if isinstance(urls, str) else list(urls), "no answer yet"
    while time.monotonic() - start < timeout_s:
        if child is not None and (code := child.poll()) is not None:
            raise NotHealthy(waiting, time.monotonic() - start, code, last)
        if check is not None:
            check()
        for url in list(waiting):
            if (answer := probe(url, get_timeout_s)) is None:
                waiting.remove(url)
            else:
                last = answer
        if not waiting:
            return time.monotonic() - start
        time.sleep(poll_s)
    raise NotHealthy(waiting, timeout_s, None, last)


def free_port() -> int:
    """A TCP port nothing listens on at 127.0.0.1 now (the OS's pick; free until someone else takes it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PortInUseError(RuntimeError):
    """The configured host:port cannot be bound."""


def bind_host(host: str | None) -> str:
    """infer `host`, or localhost when unset."""
    return host or "127.0.0.1"


def check_port_free(host: str, port: int) -> None:
    """Raise PortInUseError when `host:port` is taken (checked before vLLM spends time loading)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM's server does: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as exc:
            raise PortInUseError(f"cannot bind inference server to {host}:{port}: {exc.strerror}; another "
                                 "process holds the port (set `port` in infer.yaml or --infer.port)") from None


EXPORT_FAILED = 3
"""The exit code of a trainer that trained to its last step but could not write a final export it was asked for
(train `export.gguf`): `grpo-train` exits with it, `tidal grpo` waits for the orchestrator as after a 0 and then
exits with it too, naming the `tidal export` command that writes the file; `GRPOTrainer.train` raises."""

WRONG_POLICY = 4
"""The exit code of an orchestrator (and of `tidal grpo`) stopped by the policy identity check: an inference server
served another policy than the one it reported loaded (`tidal.orchestrator.identity`); the log's last line names
the step, the adapter / weights path and the distances."""

LOOPBACK = ("127.0.0.1", "localhost", "::1")
"""The hosts a server may bind to without an API key (`tidal.inference.backends.bind`, `tidal serve-tinker`)."""
