"""The warm pool's trainer (`tidal serve` on CPU, docs/warm-pool.md): one process keeps torch, transformers, peft and
tidal's trainer imported and the base model loaded, and forks a trainer for each run attached to the pool, so that an
attached run's trainer neither imports nor loads anything (~3-14 s of a run's start-up on a 2-core CPU,
bench/STARTUP.md).

Why a fork (and not one resident trainer that takes runs in turn): a forked trainer is a new process with a
copy-on-write view of the kept base, so nothing a run does (its LoRA merges, a full fine-tune's updates, module
patches, RNG and compile state) can reach the kept base or the next run, and a run is killed as a process. The
kept process checks it anyway: a SHA-256 of every base tensor after the load and again after each run's trainer
has ended (`trainer.json`, `checks`), and it stops (the pool with it) if one ever differs.

- `main` (`python -m tidal.colocate.warm_trainer TRAIN_YAML POOL_DIR`, started by `tidal.colocate.pool.serve` as a
  `tidal.procs.Child`): loads the base exactly as a trainer of that config would (`tidal.trainer.model.load.load_base`)
  with ONE torch thread, so that no OpenMP thread pool exists when it forks (GNU libgomp's pool does not survive a
  fork: a child's first parallel op could hang); each fork sets the thread count a fresh trainer of its run would
  have (`OMP_NUM_THREADS` of the run's environment, else torch's default in this process; `cpu_affinity` as usual).
  It listens on a unix socket (`trainer.sock`) and writes `trainer.json` (temp + rename) once it does.
- `run_forked` is `tidal grpo-train --warm-trainer SOCKET` (what `tidal grpo` starts when attached): a light relay
  that imports no torch. It sends its train config, run directory, working directory and environment, and passes
  its stdout/stderr descriptors; the fork runs the trainer (`tidal.trainer.command.run_trainer`, the base taken from
  `tidal.trainer.model.load.keep_base`, the check of `tidal.config.train.BASE_MODEL_KEYS` included) with its output
  going straight to the relay's, so the launcher sees the same `[train]` lines and log as with its own trainer.
  The relay forwards SIGTERM / SIGINT to the fork and exits with its exit code. A relay killed outright (the
  launcher's reaper, SIGKILL) closes the socket, and the fork then kills itself: nothing of the run outlives it.
- The forks run in this process's process group: `tidal serve --stop` (which stops the group) ends them too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

from tidal.config import ConfigError
from tidal.config.train import TrainConfig, base_model_key
from tidal.paths import write_atomic

SOCKET_FILE = "trainer.sock"
STATE_FILE = "trainer.json"
LOG_FILE = "trainer.log"
REQUEST_TIMEOUT_S = 30.0
"""How long the kept process waits for a connected relay's request."""
SOCKET_PATH_MAX = 107
"""Linux's limit on a unix socket's path (`sun_path`, less the NUL)."""

log = logging.getLogger("tidal.colocate.warm_trainer")


def fingerprint(model: Any) -> str:
    """SHA-256 over every parameter and buffer of `model` (names, dtypes, shapes and bytes, in order)."""
    import torch

    h = hashlib.sha256()
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            flat = t.detach().cpu().contiguous().reshape(-1)
            h.update(f"{name}:{flat.dtype}:{tuple(t.shape)};".encode())
            h.update(memoryview(flat.view(torch.uint8).numpy()))
    return h.hexdigest()


def threads_for(env: dict[str, str], default: int) -> int:
    """The torch thread count a fresh trainer started with `env` would have: its `OMP_NUM_THREADS` (when a positive
    integer), else `default` (torch's default in the kept process, measured before it went down to one)."""
    with contextlib.suppress(ValueError):
        n = int(env.get("OMP_NUM_THREADS", ""))
        if n > 0:
            return n
    return default


def _send(conn: socket.socket, obj: dict[str, Any]) -> None:
    data = json.dumps(obj).encode()
    conn.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return buf


def _recv(conn: socket.socket) -> dict[str, Any] | None:
    """One length-prefixed JSON message; None at the end of the stream."""
    head = _recv_exact(conn, 4)
    if head is None:
        return None
    body = _recv_exact(conn, struct.unpack("!I", head)[0])
    return None if body is None else json.loads(body)


# ----- the relay: `tidal grpo-train --warm-trainer SOCKET` (no torch) -----

def run_forked(sock_path: Path, cfg: TrainConfig, run_dir: Path) -> int:
    """Have the warm pool's kept process fork this run's trainer (module docs) and relay until it ends; returns its
    exit code (1 when it ended without one, e.g. killed; 128 + N after a forwarded signal N)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(sock_path))
    except OSError as exc:
        print(f"[tidal] error: the warm pool's trainer does not answer at {sock_path} ({exc}); its log: "
              f"{sock_path.parent / LOG_FILE}", file=sys.stderr, flush=True)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    _send(conn, {"config": cfg.model_dump(mode="json"), "run_dir": str(run_dir.resolve()), "cwd": os.getcwd(),
                 "env": dict(os.environ)})
    socket.send_fds(conn, [b"F"], [sys.stdout.fileno(), sys.stderr.fileno()])
    hello = _recv(conn)
    if hello is None:
        print(f"[tidal] error: the warm pool's trainer closed the connection before forking; its log: "
              f"{sock_path.parent / LOG_FILE}", file=sys.stderr, flush=True)
        return 1
    pid, forwarded = int(hello["pid"]), []

    def forward(signum: int, frame: object) -> None:
        forwarded.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    end = _recv(conn)
    if end is not None:
        return int(end["code"])
    if forwarded:
        return 128 + forwarded[-1]
    print(f"[tidal] error: the trainer forked from the warm pool (pid {pid}) ended without an exit code (killed?); "
          f"the pool's trainer log: {sock_path.parent / LOG_FILE}", file=sys.stderr, flush=True)
    return 1


# ----- the fork: one run's trainer -----

def _die_on_eof(conn: socket.socket) -> None:
    """The relay's end of the socket closed before this trainer ended: the relay is gone (killed outright), and so
    must this trainer be."""
    with contextlib.suppress(OSError):
        while conn.recv(64):
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def _child(conn: socket.socket, listener: socket.socket, req: dict[str, Any], fds: list[int],
           threads: int) -> NoReturn:
    """The forked trainer: take the relay's output, directory, environment; train; report the exit code."""
    code = 1
    try:
        listener.close()
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        import torch

        torch.set_num_threads(threads_for(req["env"], threads))
        _send(conn, {"pid": os.getpid()})
        threading.Thread(target=_die_on_eof, args=(conn,), daemon=True, name="tidal-relay-watch").start()
        logging.basicConfig(level=logging.INFO, format="%(asctime)s [train] %(message)s", datefmt="%H:%M:%S",
                            stream=sys.stdout, force=True)
        for noisy in ("httpx", "httpcore"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        logging.getLogger("tidal.trainer").info(
            "trainer pid %d forked from the warm pool's kept process (pid %d): torch, transformers, peft imported "
            "and the base loaded already; %d torch threads", os.getpid(), os.getppid(), torch.get_num_threads())
        from tidal.trainer.command import run_trainer

        code = run_trainer(TrainConfig.model_validate(req["config"]), Path(req["run_dir"]))
    except ConfigError as exc:
        print(f"tidal grpo-train: config error: {exc}", file=sys.stderr, flush=True)
        code = 2
    except BaseException:  # noqa: BLE001 - any failure is this trainer's exit code 1, its traceback in the log
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        with contextlib.suppress(OSError):
            _send(conn, {"code": code})
        os._exit(code)


# ----- the kept process -----

class Kept:
    """The kept base, its fingerprint, and the record `trainer.json` holds."""

    def __init__(self, cfg: TrainConfig, directory: Path) -> None:
        import torch

        self.default_threads = torch.get_num_threads()
        torch.set_num_threads(1)  # no OpenMP pool before a fork (module docs)
        t0 = time.monotonic()
        import peft  # noqa: F401 - imported once here, for every fork

        import tidal.trainer.command  # noqa: F401
        import tidal.trainer.grpo  # noqa: F401
        from tidal.trainer.model.load import keep_base, load_base, resolve_device

        device = resolve_device(cfg.device)
        if device.type != "cpu":
            raise ConfigError(f"the warm pool keeps a trainer on CPU only (train device {cfg.device} is {device}: "
                              f"a CUDA process cannot fork)")
        self.model = load_base(cfg, device)
        keep_base(self.model, base_model_key(cfg))
        self.load_s = time.monotonic() - t0
        self.digest = fingerprint(self.model)
        self.directory, self.key = directory, base_model_key(cfg)
        self.checks: list[dict[str, Any]] = []
        self.forks = 0

    def write(self) -> None:
        write_atomic(self.directory / STATE_FILE, json.dumps({
            "pid": os.getpid(), "socket": str(self.directory / SOCKET_FILE), "key": self.key, "digest": self.digest,
            "threads": self.default_threads, "load_s": round(self.load_s, 2), "forks": self.forks,
            "checks": self.checks}, indent=1))

    def check(self, pid: int, status: int) -> None:
        """After fork `pid` ended: the base's fingerprint again (`SystemExit` 1 if it changed)."""
        now = fingerprint(self.model)
        self.checks.append({"pid": pid, "status": status, "digest": now, "same": now == self.digest})
        self.write()
        log.info("trainer pid %d ended (status %d); kept base %s", pid, status,
                 "unchanged" if now == self.digest else "CHANGED")
        if now != self.digest:
            log.error("the kept base changed after a run (sha256 %s, loaded as %s): stopping the pool's trainer",
                      now, self.digest)
            raise SystemExit(1)


def serve_forks(kept: Kept, listener: socket.socket) -> NoReturn:
    """Accept relays and fork a trainer for each; after each fork ends, check the kept base (`Kept.check`)."""
    while True:
        with contextlib.suppress(ChildProcessError):
            while (done := os.waitpid(-1, os.WNOHANG))[0]:
                kept.check(done[0], done[1])
        ready, _, _ = select.select([listener], [], [], 0.5)
        if not ready:
            continue
        conn, _ = listener.accept()
        conn.settimeout(REQUEST_TIMEOUT_S)  # a relay that connects and says nothing must not hold the pool
        try:
            req = _recv(conn)
            _, fds, _, _ = socket.recv_fds(conn, 1, 2)
            conn.settimeout(None)
        except (OSError, ValueError) as exc:
            log.warning("a relay's request could not be read (%r)", exc)
            conn.close()
            continue
        if req is None or len(fds) != 2:
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(conn, listener, req, fds, kept.default_threads)
        for fd in fds:
            os.close(fd)
        conn.close()
        kept.forks += 1
        log.info("forked trainer pid %d for the run in %s", pid, req.get("run_dir"))


def main(argv: list[str]) -> int:
    """`python -m tidal.colocate.warm_trainer TRAIN_YAML POOL_DIR` (module docs)."""
    import yaml

    logging.basicConfig(level=logging.INFO, format="%(asctime)s [pool-trainer] %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout, force=True)
    cfg = TrainConfig.model_validate(yaml.safe_load(Path(argv[0]).read_text()))
    from tidal.procs import malloc

    try:  # the forked trainers inherit it
        log.info("%s", malloc.for_trainer(cfg.malloc, cfg.device))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    directory = Path(argv[1])
    path = directory / SOCKET_FILE
    if len(str(path).encode()) > SOCKET_PATH_MAX:
        raise ConfigError(f"the warm pool's directory {directory} is too long a path for its trainer's unix socket "
                          f"({len(str(path))} > {SOCKET_PATH_MAX} characters); set TIDAL_CACHE to a shorter one")
    kept = Kept(cfg, directory)
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen(4)
    kept.write()
    log.info("base %s loaded and kept in %.1f s (sha256 %s...); forking a trainer per attached run", cfg.model,
             kept.load_s, kept.digest[:16])
    serve_forks(kept, listener)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except ConfigError as exc:
        print(f"[pool-trainer] error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
