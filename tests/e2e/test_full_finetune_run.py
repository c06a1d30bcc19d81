"""`tidal grpo --train.lora false` (full fine-tuning) on the bundled model with real vLLM: the run completes,
every policy reaches vLLM as full weights reloaded in place, and vLLM serves exactly the trained weights (its
sampling logprobs equal the published weights' own, and differ from the base model's). The bundled model ties
its embeddings, and they train too: vLLM-CPU's packed copy of the tied lm_head is re-packed after every reload
(`tidal.inference.backends.vllm.tied_head`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import MODEL, free_port, kill_group, tidal
from tests.e2e.test_grpo_runs import check_metrics, small
from tidal.transport.batch import TrainingBatch

pytestmark = pytest.mark.vllm


def _model_from(merged: Path, tmp: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from tidal.models.sources import resolve_model

    d = tmp / "served"
    shutil.copytree(resolve_model(MODEL), d)
    shutil.copy(merged / "model.safetensors", d / "model.safetensors")
    return AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()


@pytest.mark.slow  # default suite budget: full-weight reloads and pushes are served exactly in the default arch matrix
def test_full_finetune_colocate_run_serves_the_trained_weights(tmp_path):
    from tidal.models.sources import resolve_model
    from tidal.trainer.step.logprobs import forward_logprobs

    run_dir, port = tmp_path / "run", free_port()
    proc = tidal("grpo", "--output-dir", str(run_dir), "--infer.port", str(port), *small(3), "--train.lora", "false",
                 "--train.learning_rate", "1e-4")
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    check_metrics(run_dir, 3)
    assert (run_dir / "final/model/model.safetensors").is_file() and not (run_dir / "final/adapter").exists()
    batch = TrainingBatch.load(run_dir / "rollouts/step_3.safetensors")
    policies = sorted({int(x) for x in batch.policy_steps})
    assert policies[-1] >= 1 and not (run_dir / f"broadcasts/step_{policies[-1]}/adapter_config.json").exists()
    (tmp_path / "base").mkdir()
    models = {0: _model_from(Path(resolve_model(MODEL)), tmp_path / "base")}
    for n in policies:
        if n:
            (tmp_path / f"p{n}").mkdir()
            models[n] = _model_from(run_dir / f"broadcasts/step_{n}/merged", tmp_path / f"p{n}")
    gap_served = gap_base = 0.0
    for s, n in list(zip(batch.samples(), batch.policy_steps, strict=True))[:12]:
        ids = torch.from_numpy(batch.tokens[s]).long()[None]
        pos = torch.arange(ids.shape[1])[None]
        m = torch.from_numpy(batch.loss_mask[s]).bool()
        ref = torch.from_numpy(batch.inference_logprobs[s])[m]
        with torch.no_grad():
            gap_served = max(gap_served, float((forward_logprobs(models[int(n)], ids, pos)[0][m] - ref).abs().max()))
            gap_base = max(gap_base, float((forward_logprobs(models[0], ids, pos)[0][m] - ref).abs().max()))
    assert gap_served < 1e-3, (gap_served, policies)
    assert gap_base > gap_served * 10, (gap_base, gap_served)
