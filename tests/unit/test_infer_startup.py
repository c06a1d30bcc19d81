"""`tidal grpo-infer` reaches vLLM's exec without importing torch or vllm (each costs seconds of start-up on a
small CPU machine, and the exec'd server imports them again: bench/STARTUP.md)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO, free_port

PROBE = """
import os, sys
sys.argv = ["tidal", "grpo-infer", "--infer.port", "{port}"]
def fake_exec(path, argv, env):
    heavy = sorted(m for m in ("torch", "vllm", "transformers") if m in sys.modules)
    print("EXEC", argv[2], "HEAVY", heavy, flush=True)
    os._exit(0)
os.execve = fake_exec
import tidal.reaper
tidal.reaper.start_reaper = lambda: None
from tidal.cli import main
main()
"""


def test_grpo_infer_execs_vllm_without_importing_torch_or_vllm():
    r = subprocess.run([sys.executable, "-c", PROBE.format(port=free_port())], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    line = next((x for x in r.stdout.splitlines() if x.startswith("EXEC")), None)
    assert line is not None, r.stdout + r.stderr
    assert line.endswith("HEAVY []"), line
    assert "vllm.entrypoints" in line


def test_cpu_detection_without_torch_agrees_with_torch():
    import torch

    from tidal.inference.backends.vllm.server import on_cpu

    assert on_cpu() == (not torch.cuda.is_available())
