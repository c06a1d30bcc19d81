"""Fault tolerance of real runs (bundled model, real vLLM): components are SIGKILLed and the run is resumed.

- Co-locate (default suite): the inference server is killed (the launcher restarts it, the orchestrator
  retries and reloads the policy), then the trainer is killed (everything stops, naming it and the resume
  command), then `tidal grpo --resume` runs a step and the launcher itself is SIGKILLed (every process it
  started, vLLM's engine included, must be gone within seconds: `tidal.procs.reaper`), and a last `--resume`
  finishes the run.
- Chaos (slow): three processes; trainer, orchestrator and inference are each SIGKILLed at random steps, several
  times, and restarted with `--resume`.
Both check the final step count, that `metrics.jsonl` holds every step exactly once, that the optimizer state
was restored (AdamW's step counter equals the step), and that the orchestrator's progress counters continued.
"""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import free_port, kill_group, tidal, wait_healthy
from tests.e2e.test_grpo_runs import ORCH_SMALL, alive, descendants
from tidal.monitor.metrics import read_metrics

pytestmark = pytest.mark.vllm

CKPT = ["--orch.ckpt.interval", "1", "--train.ckpt.interval", "1", "--train.ckpt.keep_last", "3",
        "--orch.ckpt.keep_last", "3"]
BATCH = 16


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    try:
        return max((r["step"] for r in read_metrics(path)), default=0)
    except (FileNotFoundError, ValueError):
        return 0


def wait_steps(run_dir: Path, n: int, procs: list[subprocess.Popen], timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while steps_done(run_dir) < n:
        for p in procs:
            assert p.poll() is None, (p.args, p.stdout.read()[-3000:] if p.stdout else "")
        assert time.monotonic() < deadline, f"step {n} not reached"
        time.sleep(0.2)


def resumed_steps(run_dir: Path) -> list[int]:
    """Steps a resumed trainer recorded (a line being written counts once it is complete)."""
    try:
        return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if r.get("resumed_from", 0) > 0]
    except (FileNotFoundError, ValueError):
        return []


def check_resumed_run(run_dir: Path, steps: int) -> list[dict]:
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), [r["step"] for r in rows]
    assert [r["optimizer_steps"] for r in rows] == list(range(1, steps + 1)), "optimizer state was restored"
    assert [r["progress/total_samples"] for r in rows] == [BATCH * s for s in range(1, steps + 1)]
    assert any(r["resumed_from"] > 0 for r in rows)
    assert (run_dir / "final/adapter/adapter_model.safetensors").is_file()
    return rows


def vllm_server_process(root: int) -> psutil.Process:
    found = [p for p in descendants(root) if "vllm.entrypoints" in " ".join(p.cmdline())]
    assert found, "no vLLM API server process"
    return found[0]


@pytest.mark.slow  # default suite budget: the longest e2e test (killed-trainer resume: test_trainer_resume.py)
def test_colocate_survives_inference_death_and_resumes_after_trainer_death(tmp_path):
    run_dir, port, steps = tmp_path / "run", free_port(), 6
    args = ["grpo", "--output-dir", str(run_dir), "--infer.port", str(port), "--orch.max_steps", str(steps),
            *ORCH_SMALL, *CKPT]
    proc = tidal(*args)
    try:
        wait_steps(run_dir, 2, [proc])
        vllm_server_process(proc.pid).send_signal(signal.SIGKILL)
        wait_steps(run_dir, 4, [proc], timeout=600)  # inference restarted, the run went on
        family = descendants(proc.pid)
        trainer = [p for p in family if "grpo-train" in " ".join(p.cmdline())]
        trainer[0].send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    assert proc.returncode == 1
    assert "inference server exited" in out and "restarting it (1 of 3)" in out
    assert "the trainer exited" in out and "resume the run with: tidal grpo" in out and "--resume" in out
    time.sleep(1)  # a dead trainer stops everything: no orphan, the server's port is closed
    left = alive(family)
    assert not left, f"orphans left: {[p.cmdline() for p in left]}"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1)
    orch_log = (run_dir / "logs/orch.log").read_text()
    assert "inference request failed" in orch_log or "inference server restarted" in orch_log

    proc = tidal(*args, "--resume")  # resumed, then the launcher itself is SIGKILLed after one more step
    try:
        deadline = time.monotonic() + 400
        while not resumed_steps(run_dir):
            assert proc.poll() is None and time.monotonic() < deadline, "the resumed run trained no step"
            time.sleep(0.2)
        family = descendants(proc.pid)
        assert any("vllm.entrypoints" in " ".join(p.cmdline()) for p in family)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while alive(family) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = alive(family)
        assert not left, f"the launcher's death left these running: {[p.cmdline() for p in left]}"
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1)
    finally:
        kill_group(proc)

    proc = tidal(*args, "--resume")
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "resuming the run" in out and "resumed from checkpoint step" in out
    check_resumed_run(run_dir, steps)


@pytest.mark.slow
def test_chaos_three_processes_killed_at_random_steps(tmp_path):
    rnd = random.Random(1234)
    run_dir, port, steps = tmp_path / "run", free_port(), 12
    url = f"http://127.0.0.1:{port}/v1"
    args = {"orch": ["grpo-orch", "--output-dir", str(run_dir), "--orch.client.base_url", f"[{url}]",
                     "--orch.max_steps", str(steps), *ORCH_SMALL, "--orch.ckpt.interval", "1",
                     "--orch.ckpt.keep_last", "2"],
            "train": ["grpo-train", "--output-dir", str(run_dir), "--train.ckpt.interval", "2",
                      "--train.ckpt.keep_last", "2"],
            "infer": ["grpo-infer", "--infer.port", str(port)]}
    logs = {who: open(tmp_path / f"{who}.log", "a") for who in args}  # noqa: SIM115 - closed at the end

    def start(who: str, *extra: str) -> subprocess.Popen:
        return tidal(*args[who], *extra, stdout=logs[who])

    procs = {"infer": start("infer")}
    try:
        wait_healthy(port, procs["infer"])
        procs["orch"], procs["train"] = start("orch"), start("train")
        plan = ["train", "orch", "infer", "train", "orch"]
        rnd.shuffle(plan)
        kill_at = sorted(rnd.sample(range(1, steps - 1), len(plan)))
        for who, at in zip(plan, kill_at, strict=True):
            wait_steps(run_dir, at, [procs["train"]], timeout=600)
            time.sleep(rnd.uniform(0, 2))
            assert procs[who].poll() is None, f"{who} ended before it could be killed"
            kill_group(procs[who]) if who == "infer" else procs[who].send_signal(signal.SIGKILL)
            procs[who].wait()
            procs[who] = start(who) if who == "infer" else start(who, "--resume")
        for who in ("orch", "train"):
            procs[who].wait(timeout=900)
            assert procs[who].returncode == 0, (tmp_path / f"{who}.log").read_text()[-4000:]
    finally:
        for p in procs.values():
            kill_group(p)
        for f in logs.values():
            f.close()
    check_resumed_run(run_dir, steps)
    train_log, orch_log = (tmp_path / "train.log").read_text(), (tmp_path / "orch.log").read_text()
    assert train_log.count("resumed from checkpoint step") == 2
    assert orch_log.count("resumed from checkpoint step") == 2
    assert "inference request failed" in orch_log or "inference server restarted" in orch_log
