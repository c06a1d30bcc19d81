"""A CUDA out-of-memory error in the trainer ends `tidal grpo-train` with exit 1 and one line naming the peak, the
estimate and the keys (R6 in docs/gpu.md; `tidal.trainer.memory.exits_on_oom`), not a traceback.

CPU cannot run out of CUDA memory, so the error is raised where the allocator would raise it, in a real
`tidal grpo-train` process: tests/oom_hook/sitecustomize.py makes the named function of `tidal.trainer.grpo` raise
`torch.cuda.OutOfMemoryError` (here the policy's build, the trainer's first allocation). The whole launcher with
vLLM (every child stopped, nothing left) is tests/e2e/test_trainer_oom_run.py (slow); on a GPU, scripts/
gpu_check.py's row `o` forces a real one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HOOK = Path(__file__).resolve().parents[1] / "oom_hook"


def hooked_env(at: str) -> dict[str, str]:
    return {**os.environ, "TIDAL_TEST_OOM_AT": at,
            "PYTHONPATH": os.pathsep.join([str(HOOK), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def test_a_trainer_oom_exits_1_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo-train", "--output-dir", str(tmp_path / "run"),
                           "--train.device", "cpu"], env=hooked_env("build_policy"), capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    lines = [ln for ln in out.splitlines() if "out of memory" in ln.lower()]
    assert len(lines) == 1, lines
    assert "stopping: CUDA out of memory in the trainer: measured peak" in lines[0]
    for key in ("estimate", "per_device_train_batch_size", "infer gpu_memory_utilization"):
        assert key in lines[0], key
    assert "Traceback" not in out
