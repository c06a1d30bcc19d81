"""A verifiers 0.4 taskset with a toolset through `tidal grpo` and real vLLM (slow: the classic adapter's run,
tests/e2e/test_tool_run.py, covers the loop itself; tests/unit/test_verifiers04.py the 0.4 sessions and scoring).
The run puts verifiers 0.4 (`make setup-dev`: .venv/verifiers04) first on PYTHONPATH."""

from __future__ import annotations

import os

import pytest

from tests.conftest import free_port, kill_group, tidal
from tests.e2e.test_tool_run import tool_turns_of
from tests.e2e.tool_env import tagged_tool_model
from tests.unit.test_verifiers04 import ROOT, VF04
from tidal.monitor.metrics import read_metrics
from tidal.transport.batch import TrainingBatch

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_verifiers04_toolset_run(tmp_path):
    """The tagged model's `<tool_call>` blocks do not parse: each is answered with its error as a tool message
    (the 0.4 session's answer), spliced in as tokens, and the task's reward counts the tool messages."""
    if not (VF04 / "verifiers" / "v1").is_dir():
        pytest.skip(f"verifiers 0.4 is not installed in {VF04} (make setup-dev installs it)")
    from tidal.trainer.model.load import load_tokenizer

    model, run_dir = tagged_tool_model(tmp_path / "model"), tmp_path / "run"
    path = os.pathsep.join([str(VF04), str(ROOT), os.environ.get("PYTHONPATH", "")])
    proc = tidal("grpo", "--model", str(model), "--output-dir", str(run_dir), "--infer.port", str(free_port()),
                 "--orch.max_steps", "2", "--orch.env", "[{id: 'tests.e2e.vf4_reverse:build_tool_taskset'}]",
                 "--orch.batch_size", "16", "--orch.rollouts_per_example", "4", "--orch.sampling.max_tokens", "160",
                 "--orch.sampling.seed", "7", "--train.max_async_level", "8", env={**os.environ, "PYTHONPATH": path})
    try:
        out, _ = proc.communicate(timeout=1800)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    turns = tool_turns_of(TrainingBatch.load(run_dir / "rollouts" / "step_1.safetensors"), load_tokenizer(str(model)))
    assert len(turns) >= 8, "rollouts got the tool message and went on"
    assert all(t.startswith("\n<|im_start|>tool\nerror: ") and t.endswith("<|im_end|>\n<|im_start|>assistant\n")
               for t in turns), turns[:3]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["mismatch_kl"] < 1e-3
    assert rows[0]["reward/mean"] > 0, "the task's reward counted the tool messages"
