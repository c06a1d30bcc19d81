"""The seed's three Quick Start files (seed 000, as written there: `recipe: fp8-hybrid`, LoRA, the loss keys)
run as given on this machine with the bundled model in place of Qwen3-0.6B: `tidal grpo --train --infer --orch`
with only the run's size cut on the command line (one step of a small batch, short completions, and `seq_len`
2048, beyond the bundled model's 1024 positions, cut to 512), so the recipe's
FP8 emulation, vLLM and the loop all run. `slow`: the default suite runs the same pieces in smaller tests."""

from __future__ import annotations

import pytest

from tests.conftest import free_port, kill_group, tidal
from tests.unit.test_config import SEED_INFER, SEED_ORCH, SEED_TRAIN
from tidal.monitor.metrics import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
BUNDLED = "tidal:tiny-reverse"


def test_seed_quick_start_files_run_on_cpu(tmp_path):
    paths = {}
    for kind, text in (("train", SEED_TRAIN), ("infer", SEED_INFER), ("orch", SEED_ORCH)):
        paths[kind] = tmp_path / f"{kind}.yaml"
        paths[kind].write_text(text.replace('"Qwen/Qwen3-0.6B"', f'"{BUNDLED}"'))
    run_dir = tmp_path / "run"
    proc = tidal("grpo", "--train", str(paths["train"]), "--infer", str(paths["infer"]), "--orch",
                 str(paths["orch"]), "--output-dir", str(run_dir), "--infer.port", str(free_port()),
                 "--orch.max_steps", "1", "--orch.batch_size", "16", "--orch.rollouts_per_example", "4",
                 "--orch.sampling.max_tokens", "24", "--orch.seq_len", "512", "--train.sequence_len", "512")
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "recipe fp8-hybrid" in out and "emulating" in out, "the seed's recipe ran (emulated FP8 on CPU)"
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["mismatch_kl"] < 0.05, "fp8 rounding only: the sampled tokens are still the model's"
