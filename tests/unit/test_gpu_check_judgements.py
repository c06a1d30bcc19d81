"""The judgements of `make gpu-check` rows on CPU, fed tables (issue 48, item 3): e2 passes only when the device was
busy more than half of the wall time and every matmul and attention row is above zero; g and g4 fail when the planned
split is below NVML's peak (above the use before) or more than 1.25x it; a check not reached fails the exit code;
the default budget covers every selected check; a UUID in CUDA_VISIBLE_DEVICES maps to its NVML index.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "bench"))

import gpu_check  # noqa: E402
import gpu_check_rows  # noqa: E402
import gpu_memory  # noqa: E402

KINDS = ("base matmuls", "LoRA matmuls", "attention forward", "attention backward",
         "norms, activations, RoPE, other elementwise", "recomputation (checkpoint)", "logprob / LM-head pass",
         "optimizer", "host gaps (wall - device busy)")


def profile_row(busy_share: float, zero: tuple[str, ...] = (), seed: int = 0) -> dict:
    """A PROFILE_ROW as bench/gpu_trainer.py prints it: seconds per kind adding up to `wall_s`, the device busy
    `busy_share` of it, spread at random over the kinds but those in `zero`."""
    rng = random.Random(seed)
    wall = rng.uniform(0.5, 3.0)
    kinds = [k for k in KINDS[:-1] if k not in zero]
    weights = [rng.uniform(0.1, 1.0) for _ in kinds]
    rows = {k: 0.0 for k in KINDS[:-1]}
    rows |= {k: wall * busy_share * w / sum(weights) for k, w in zip(kinds, weights, strict=True)}
    rows[KINDS[-1]] = wall * (1 - busy_share)
    return {"model": "4b", "shape": "prime-rl", "step_s": wall, "rows": rows, "wall_s": wall}


@pytest.mark.parametrize("seed", range(5))
def test_e2_passes_a_busy_profile_and_fails_host_gaps_or_missing_kernels(seed):
    assert gpu_check.profile_problem([profile_row(0.9, seed=seed), profile_row(0.51, seed=seed + 9)]) is None
    gaps = gpu_check.profile_problem([profile_row(0.9, seed=seed), profile_row(0.49, seed=seed)])
    assert gaps is not None and "busy 49%" in gaps
    assert "busy" in gpu_check.profile_problem([profile_row(0.0, seed=seed)])
    for kind in ("base matmuls", "LoRA matmuls", "attention forward", "attention backward"):
        problem = gpu_check.profile_problem([profile_row(0.95, zero=(kind,), seed=seed)])
        assert problem is not None and kind in problem
    assert gpu_check.profile_problem([profile_row(0.95, zero=("optimizer",), seed=seed)]) is None


def test_e2_fails_a_table_without_its_rows():
    assert "no wall time" in gpu_check.profile_problem([{"model": "x", "shape": "y", "rows": {}, "wall_s": 0}])
    row = profile_row(0.9)
    row["rows"] = {k: v for k, v in row["rows"].items() if "matmul" not in k and "attention" not in k}
    assert "no matmul or attention rows" in gpu_check.profile_problem([row])


def split(planned, peak, before=0.5):
    return {"planned GiB": planned, "NVML peak GiB (all processes)": peak, "NVML before GiB": before}


def test_g_and_g4_fail_a_split_below_the_peak_or_above_1_25x_it():
    assert gpu_check_rows.split_problem(split(60.0, 55.5)) is None  # 60 vs 55.0 used: 1.09x
    assert gpu_check_rows.split_problem(split(55.0, 55.5)) is None  # exactly the peak
    assert "<" in gpu_check_rows.split_problem(split(54.0, 55.5))
    assert gpu_check_rows.split_problem(split(1.25 * 40.0, 40.5)) is None
    assert "1.25x" in gpu_check_rows.split_problem(split(1.26 * 40.0, 40.5))
    assert "no split notice" in gpu_check_rows.split_problem(split(None, 40.0))
    assert "no NVML peak" in gpu_check_rows.split_problem(split(40.0, float("nan")))


def test_the_split_figures_come_from_the_notice_tidal_prints():
    line = "[tidal] GPU (79.2 GiB): vLLM 60.5 GiB (x), trainer needs 9.5 of the 18.7 GiB left"
    assert gpu_check_rows.planned_gib(f"a\n{line}\nb") == pytest.approx(70.0)
    assert gpu_check_rows.planned_gib("nothing") is None


def test_not_reached_fails_the_exit_code_and_skipped_does_not():
    def res(status):
        return gpu_check.Result("x", "x", status=status)

    assert gpu_check.exit_code([res("pass"), res("skipped")]) == 0
    assert gpu_check.exit_code([res("pass"), res("not reached")]) == 1
    assert gpu_check.exit_code([res("FAIL"), res("pass")]) == 1
    line = gpu_check.ledger_line(gpu_check.Result("g4", "t", status="FAIL", figures={"k": [1]}, detail="why"))
    assert json.loads(line.removeprefix("LEDGER_RESULT ")) == {"row": "g4", "status": "FAIL",
                                                               "figure": "g4: k: [1]; why"}


def test_the_default_budget_is_every_selected_check():
    checks = gpu_check.CHECKS
    gpu_all = gpu_check.default_budget(checks, False, None, long=True)
    assert gpu_all == sum(c.gpu_s for c in checks)
    assert gpu_check.default_budget(checks, False, None, long=False) == sum(
        c.gpu_s for c in checks if not c.name.startswith("L"))
    assert gpu_check.default_budget(checks, False, {"g4", "o"}, long=False) == 480 + 240
    assert gpu_check.default_budget(checks, True, None, long=False) == sum(c.cpu_s or 0 for c in checks)


def test_a_uuid_in_cuda_visible_devices_maps_to_its_nvml_index():
    uuids = ["GPU-1111aaaa-0000", b"GPU-2222bbbb-0000", "GPU-2223cccc-0000"]
    assert gpu_memory.visible_device(None) == "0" and gpu_memory.visible_device("3,1") == "3"
    assert gpu_memory.nvml_index("3", uuids) == 3
    assert gpu_memory.nvml_index(gpu_memory.visible_device("GPU-2222bbbb-0000,GPU-1111aaaa-0000"), uuids) == 1
    assert gpu_memory.nvml_index("GPU-1111", uuids) == 0  # a unique prefix, as CUDA takes it
    with pytest.raises(ValueError, match="matches 2"):
        gpu_memory.nvml_index("GPU-222", uuids)
    with pytest.raises(ValueError, match="matches 0"):
        gpu_memory.nvml_index("MIG-9", uuids)
