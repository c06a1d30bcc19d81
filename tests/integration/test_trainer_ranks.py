"""The real trainer process (`tidal grpo-train`) with several ranks (CPU, gloo) on fixed batch files:

- `gpus: 2`: a rank SIGKILLed mid-run stops the trainer (exit 1, the rank named, no process left), and
  `--resume` with 2 ranks ends bit-identical to an uninterrupted 2-rank run; the metrics say 2 ranks trained.
- Multi-node: two "nodes" on localhost (`torchrun --nnodes 2 --node-rank i`, rendezvous on 127.0.0.1) train.
- (slow) A checkpoint written by 2 ranks resumes with 1 rank and ends where a 1-rank run ends (up to float
  summation order), and a 1-rank checkpoint resumes with 2 ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import free_port, kill_group
from tests.integration.test_trainer_resume import STEPS, TRAIN, finish, run_trainer, steps_done, write_batches
from tidal.monitor.metrics import read_metrics

TWO = ["--train.gpus", "2", "--train.zero_level", "3"]


def adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final/adapter/adapter_model.safetensors"))


def rank_process(root: int, rank: int) -> psutil.Process:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for p in psutil.Process(root).children(recursive=True):
            try:
                if "grpo-train" in " ".join(p.cmdline()) and p.environ().get("RANK") == str(rank):
                    return p
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.2)
    raise AssertionError(f"no rank {rank} process under {root}")


@pytest.fixture(scope="module")
def two_rank_reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("ref2")
    write_batches(run_dir)
    out = finish(run_trainer(run_dir, *TWO))
    assert "starting 2 trainer ranks" in out
    return run_dir


@pytest.mark.slow  # two torchrun ranks killed and resumed: make test-all (the default suite keeps two gloo ranks
# training like one, tests/unit/test_distributed_trainer.py, and a killed trainer resuming exactly)
def test_killed_rank_stops_the_trainer_and_resume_is_exact(tmp_path, two_rank_reference):
    write_batches(tmp_path)
    ckpt = ["--train.ckpt.interval", "1"]
    proc = run_trainer(tmp_path, *TWO, *ckpt)
    try:
        victim = rank_process(proc.pid, 1)
        family = psutil.Process(proc.pid).children(recursive=True)
        deadline = time.monotonic() + 300
        while steps_done(tmp_path) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.05)
        victim.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    assert proc.returncode == 1, out[-3000:]
    assert "trainer rank 1" in out and "killed by SIGKILL" in out, out[-3000:]
    time.sleep(1)
    left = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [p.cmdline() for p in left]
    assert steps_done(tmp_path) < STEPS

    out = finish(run_trainer(tmp_path, *TWO, *ckpt, "--resume"))
    assert "resumed from checkpoint step" in out
    rows, ref = read_metrics(tmp_path / "metrics.jsonl"), read_metrics(two_rank_reference / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["trainer_ranks"] == 2 for r in rows)
    assert [r["optimizer_steps"] for r in rows] == [r["optimizer_steps"] for r in ref]
    for r, q in zip(rows, ref, strict=True):
        assert r["loss"] == q["loss"] and r["grad_norm"] == q["grad_norm"], r["step"]
    a, b = adapter(tmp_path), adapter(two_rank_reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "bit-identical final adapter"
    assert max(float(v.abs().max()) for k, v in a.items() if "lora_B" in k) > 0


@pytest.mark.slow  # two torchrun launchers on 2 cores: make test-all (the default suite keeps two gloo ranks)
def test_two_nodes_on_localhost(tmp_path):
    write_batches(tmp_path)
    port, env = free_port(), {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                               "1", "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port",
                               str(port), "-m", "tidal.cli", "grpo-train", "--output-dir", str(tmp_path), *TRAIN,
                               "--train.max_steps", "2"], start_new_session=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for node in (0, 1)]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            kill_group(p)
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(r["trainer_ranks"] == 2 for r in rows)
    assert (tmp_path / "broadcasts/step_2/STABLE").exists()


@pytest.mark.slow
@pytest.mark.parametrize(("first", "then"), [(TWO, []), ([], TWO)])
def test_resume_with_another_rank_count(tmp_path, two_rank_reference, first, then):
    write_batches(tmp_path)
    ckpt = ["--train.ckpt.interval", "3"]
    finish(run_trainer(tmp_path, *first, *ckpt, "--train.max_steps", "3"))
    out = finish(run_trainer(tmp_path, *then, *ckpt, "--resume"))
    assert "resumed from checkpoint step 3" in out
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["trainer_ranks"] for r in rows] == [1 + (first == TWO)] * 3 + [1 + (then == TWO)] * 3
    assert rows[-1]["optimizer_steps"] == read_metrics(two_rank_reference / "metrics.jsonl")[-1]["optimizer_steps"]
    a, b = adapter(tmp_path), adapter(two_rank_reference)  # 1 and 2 ranks differ in summation order only
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=5e-5, msg=k)
