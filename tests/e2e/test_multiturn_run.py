"""A multi-turn tool-environment run end to end with real vLLM: environment replies are inserted as tokens
with no loss, the model continues from the exact token ids, and trainer and inference still agree; the
online evaluation of the environment runs its turns too."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import free_port, kill_group, tidal
from tests.e2e.test_grpo_runs import ORCH_SMALL
from tidal.monitor.metrics import read_metrics
from tidal.transport.batch import TrainingBatch

pytestmark = pytest.mark.vllm


@pytest.mark.slow  # default suite budget: multi-turn rollouts through real vLLM run in test_tool_run.py
def test_multi_turn_tool_environment_run(tmp_path):
    run_dir, port = tmp_path / "run", free_port()
    proc = tidal("grpo", "--output-dir", str(run_dir), "--infer.port", str(port), "--orch.max_steps", "2",
                 *ORCH_SMALL, "--orch.env", "[{id: 'tests.e2e.multiturn_env:EchoTool'}]",
                 "--orch.eval", "{env: [{id: 'tests.e2e.multiturn_env:EchoTool', name: echo}], num_examples: 4, "
                 "rollouts_per_example: 2, interval: 1}")
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    batch = TrainingBatch.load(run_dir / "rollouts" / "step_1.safetensors")
    prompt_end = [int(np.argmax(batch.loss_mask[s] > 0)) for s in batch.samples()]
    # a completion with a reply: loss mask 1 (turn 1), 0 (the reply's tokens), 1 again (turn 2)
    gaps = [np.count_nonzero(np.diff(batch.loss_mask[s][p:].astype(int)) == 1)
            for s, p in zip(batch.samples(), prompt_end, strict=True)]
    assert sum(g >= 1 for g in gaps) >= len(gaps) // 2, gaps
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["mismatch_kl"] < 1e-3, "turn-2 tokens were sampled from the exact token ids trained on"
    assert rows[0]["reward/echo-tool/mean"] is not None
    evals = read_metrics(run_dir / "eval.jsonl")
    assert evals and evals[0]["policy_step"] == 0
    assert all(e["eval/echo/turns/mean"] > 1 for e in evals), "evaluation runs the environment's turns too"
