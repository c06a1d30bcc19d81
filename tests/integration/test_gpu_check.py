"""`make gpu-check` cannot rot: its CPU mode runs in `make test-all`, its runner in the default suite (issue 33).

The CPU mode runs the checks that mean something on CPU (environment and vLLM's features, vLLM started with the
trainer's LoRA targets and an adapter loaded and applied, `tidal serve-tinker` driven by the tinker SDK, the trainer
benchmark as a 1-layer smoke) and writes the same report the GPU mode does; both tests of it are `slow` (make
test-all): the two rows that start no vLLM (a, e) through the script's own entry point and report, and the whole CPU
mode (two more vLLM starts, several minutes on 2 cores). The default suite runs the check runner itself (a failing
or crashing check does not stop the next one, a check the deadline leaves no room for is reported as not reached and
fails the exit code) and the rows' judgements on tables (e2's profile, g / g4's split against NVML's peak).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check  # noqa: E402
import pytest  # noqa: E402


def report_rows(out: Path) -> dict[str, str]:
    """check -> result, from the report's first table (a check's own section may hold tables of its figures)."""
    lines = out.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| check |"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("| "):
            break
        rows[line.split("|")[1].strip()] = line.split("|")[3].strip()
    return rows


@pytest.mark.slow  # the script end to end: make test-all (the default suite keeps its deadline and failure checks)
def test_cpu_mode_rows_without_vllm_run_and_report(tmp_path):
    out = tmp_path / "GPU-CHECK.md"
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--cpu", "--only", "a,e", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = report_rows(out)
    assert rows["a"] == rows["e"] == "pass", rows
    assert all(status == "skipped" for name, status in rows.items() if name not in ("a", "e")), rows
    assert "Qwen3-0.6B" in out.read_text()


@pytest.mark.slow  # two cold vLLM starts (b, t) besides a and e: several minutes on 2 cores
def test_cpu_mode_runs_and_reports(tmp_path):
    out = tmp_path / "GPU-CHECK.md"
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--cpu", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = report_rows(out)
    assert rows["a"] == rows["b"] == rows["e"] == "pass", rows
    # t: serve-tinker driven by the SDK (skipped only where the optional `tinker` extra is not installed)
    assert rows["t"] == ("pass" if importlib.util.find_spec("tinker") else "skipped"), rows
    assert all(rows[k] == "skipped" for k in ["c", "c2", *"fghijk", "g4", "s", "o", "L1", "L2", "L3", "L4"]), rows
    text = out.read_text()
    assert "ready_s" in text and "--lora-target-modules" in text and "Qwen3-0.6B" in text
    if importlib.util.find_spec("tinker"):
        assert "cross_entropy loss:sum" in text and "logprob change of the step-0 tokens" in text


def test_a_failure_does_not_stop_the_next_check_and_the_deadline_is_kept(tmp_path):
    seen = []

    def fails(ctx, res):
        seen.append("fails")
        raise gpu_check.CheckFailed("the claim does not hold")

    def crashes(ctx, res):
        seen.append("crashes")
        raise KeyError("broken check")

    def passes(ctx, res):
        seen.append("passes")
        res.figures["x"] = 1

    checks = (gpu_check.Check("a", "fails", fails, 10, 10, 1), gpu_check.Check("b", "crashes", crashes, 10, 10, 1),
              gpu_check.Check("c", "passes", passes, 10, 10, 1), gpu_check.Check("d", "gpu only", passes, 10, None, 1),
              gpu_check.Check("e", "too long", passes, 10, 10, 3600))
    ctx = gpu_check.Ctx(cpu=True, work=tmp_path, deadline=time.monotonic() + 60, long=False)
    results = gpu_check.run_checks(ctx, None, checks)
    assert seen == ["fails", "crashes", "passes"]
    assert [r.status for r in results] == ["FAIL", "FAIL", "pass", "skipped", "not reached"]
    assert "KeyError" in results[1].detail and results[2].figures == {"x": 1}
    text = gpu_check.report(ctx, results, "cmd", 1.0)
    assert "## a. fails: FAIL" in text and "the claim does not hold" in text


def test_the_rows_read_the_split_tidal_prints():
    """Rows g, g4, o and L1-L4 print the split tidal planned beside NVML's peak: the notice they parse is the one
    `tidal.colocate.split` writes (here for the 0.6B shape on a fake 80 GB GPU)."""
    import gpu_check_rows

    from tidal.colocate.derive import Machine, ModelFacts, derive_colocate
    from tidal.config import InferConfig, OrchConfig, TrainConfig

    facts = ModelFacts(config={**gpu_check.QWEN3_0_6B, "model_type": "qwen3"})
    co = derive_colocate(TrainConfig(model="m"), InferConfig(model="m"), OrchConfig(),
                         Machine(has_gpu=True, gpu_memory_gib=79.18), model=facts)
    line = "[tidal] " + next(n for n in co.placement.notices if n.startswith("GPU ("))
    planned = gpu_check_rows.planned_split(f"noise\n{line}\nmore")
    assert list(planned.values())[0].endswith("of 79.2"), planned
    assert gpu_check_rows.planned_split("nothing") == {"planned": "no split notice"}
    assert gpu_check_rows.planned_gib(f"noise\n{line}\nmore") == pytest.approx(
        sum(float(x) for x in list(planned.values())[0].split("=")[0].split("+")))
    assert gpu_check_rows.base.CheckFailed is gpu_check.CheckFailed, "one harness for the rows and the script"
    names = [c.name for c in gpu_check.CHECKS]
    assert len(names) == len(set(names)) and names.index("g4") == names.index("g") + 1
