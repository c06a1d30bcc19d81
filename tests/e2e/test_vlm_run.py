"""A vision-language GRPO run end to end with real vLLM: a random tiny Idefics3 on the synthetic square-colour
task. Prompts carry images (PIL, data URL and file forms) to vLLM's chat API; the batch carries the images to
the trainer, which embeds them as vLLM does: trainer and vLLM logprobs agree at both steps, including step 2,
sampled with the trained LoRA adapter (max_async_level 0), which holds language-model modules only."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import safe_open

from tests.conftest import free_port, kill_group, tidal
from tests.e2e.test_grpo_runs import ORCH_SMALL
from tests.tiny_vlm import IMAGE_TOKEN_ID, TOKENS_PER_IMAGE, build_tiny_vlm
from tidal.monitor.metrics import read_metrics
from tidal.transport.batch import TrainingBatch

pytestmark = pytest.mark.vllm


def test_vlm_grpo_run_agrees_with_vllm(tmp_path):
    model = build_tiny_vlm(tmp_path / "tiny-vlm")
    run_dir, port = tmp_path / "run", free_port()
    env = json.dumps([{"id": "tests.e2e.vlm_env:SquareColour", "args": {"image_dir": str(tmp_path / "images")}}])
    proc = tidal("grpo", "--model", str(model), "--output-dir", str(run_dir), "--infer.port", str(port),
                 "--orch.max_steps", "2", "--orch.max_async_level", "0", *ORCH_SMALL, "--orch.env", env)
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["mismatch_kl"] <= 1e-3 for r in rows), [r["mismatch_kl"] for r in rows]
    assert all(r["off_policy_level"] == 0 for r in rows), "step 2 was sampled with the trained adapter"
    assert any(r["grad_norm"] > 0 for r in rows), "rewards differed, the policy got a gradient"
    batch = TrainingBatch.load(run_dir / "rollouts" / "step_1.safetensors")
    assert batch.has_images and len(batch.image_lengths) == 4, "4 prompts, one distinct image each"
    for i, s in enumerate(batch.samples()):
        prompt = batch.tokens[s][:batch.prompt_lengths[i]]
        assert np.count_nonzero(prompt == IMAGE_TOKEN_ID) == TOKENS_PER_IMAGE, "vLLM expanded the placeholder"
        assert not batch.loss_mask[s][:batch.prompt_lengths[i]].any()
    (adapter,) = (run_dir / "final" / "adapter").glob("*.safetensors")
    with safe_open(str(adapter), "np") as f:
        keys = list(f.keys())
    assert keys and all(".text_model." in k for k in keys), keys[:4]
