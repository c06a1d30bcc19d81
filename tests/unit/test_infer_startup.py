"""`tidal grpo-infer` reaches vLLM's exec without importing torch or vllm (each costs seconds of start-up on a
small CPU machine, and the exec'd server imports them again: bench/STARTUP.md), and says in one line at start when
it serves LoRA adapters on CPU, slower than `tidal grpo` there, naming the keys that change it."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO, free_port

PROBE = """
import os, sys
sys.argv = ["tidal", "grpo-infer", "--infer.port", "{port}", *{extra!r}]
def fake_exec(path, argv, env):
    heavy = sorted(m for m in ("torch", "vllm", "transformers") if m in sys.modules)
    print("EXEC", argv[2], "HEAVY", heavy, flush=True)
    os._exit(0)
os.execve = fake_exec
import tidal.procs.reaper
tidal.procs.reaper.start_reaper = lambda: None
from tidal.cli import main
main()
"""


def probe(*extra: str) -> str:
    r = subprocess.run([sys.executable, "-c", PROBE.format(port=free_port(), extra=list(extra))],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    return r.stdout + r.stderr


def test_grpo_infer_execs_vllm_without_importing_torch_or_vllm():
    out = probe()
    line = next((x for x in out.splitlines() if x.startswith("EXEC")), None)
    assert line is not None, out
    assert line.endswith("HEAVY []"), line
    assert "vllm.entrypoints" in line


def test_grpo_infer_on_cpu_says_once_why_lora_is_slower_and_which_keys_change_it():
    from tidal.config.infer import InferConfig
    from tidal.inference.backends.vllm.server import cpu_lora_notice, on_cpu

    assert cpu_lora_notice(InferConfig(model="m"), cpu=False) is None, "a GPU serves LoRA at speed"
    assert cpu_lora_notice(InferConfig(model="m", enable_lora=False, weight_reload=True), cpu=True) is None
    assert cpu_lora_notice(InferConfig(model="m", weight_reload=True), cpu=True) is not None, "LoRA layers still"
    if not on_cpu():
        return
    lines = [x for x in probe().splitlines() if "LoRA adapters" in x]  # the bundled infer.yaml: LoRA adapters
    assert len(lines) == 1 and "~5x slower" in lines[0], lines
    for key in ("enable_lora: false", "weight_reload: true", "reload: merged", "broadcast_merged: true"):
        assert key in lines[0]
    out = probe("--infer.enable_lora", "false", "--infer.weight_reload", "true")
    assert "EXEC" in out and "LoRA adapters" not in out, out


def test_cpu_detection_without_torch_agrees_with_torch():
    import torch

    from tidal.inference.backends.vllm.server import on_cpu

    assert on_cpu() == (not torch.cuda.is_available())
