"""A vision-language GRPO run end to end with real vLLM: a random tiny Idefics3 on the synthetic square-colour
task. Prompts carry images (PIL, data URL and file forms) to vLLM's chat API; the batch carries the images to
the trainer, which embeds them as vLLM does: trainer and vLLM logprobs agree at both steps, including step 2,
sampled with the trained policy (max_async_level 0) that vLLM loaded as a LoRA adapter (language-model modules
only) or, slow, as merged full weights; the base model's logprobs show that vLLM really served the trained
policy at step 2. The online evaluation samples the bundled visual-shapes environment's image prompts the same
way (training keeps the square-colour task: its shaped reward gives a random model's completions different
rewards, so step 1 has a gradient; visual-shapes' exact-match reward is 0 for them). Slow: the same with full
fine-tuning (`lora: false`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from tests.conftest import free_port, kill_group, tidal
from tests.e2e.test_grpo_runs import ORCH_SMALL
from tests.tiny_vlm import IMAGE_TOKEN_ID, TOKENS_PER_IMAGE, build_tiny_vlm
from tidal.monitor.metrics import read_metrics
from tidal.transport.batch import TrainingBatch

pytestmark = pytest.mark.vllm


def base_model_gap(model_dir: Path, batch: TrainingBatch) -> float:
    """Mean |base model logprob - vLLM logprob| over the batch's completion tokens (the trainer's image path)."""
    from transformers import AutoModelForImageTextToText

    from tidal.trainer.model.vision import attach_images
    from tidal.trainer.step.logprobs import forward_logprobs
    from tidal.trainer.step.packing import pack

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    micro = pack(batch, 512, 4)
    attach_images(model, batch, micro, str(model_dir), "tiny-vlm")
    gaps = []
    with torch.no_grad():
        for mb in micro:
            lp = forward_logprobs(model, mb.input_ids, mb.position_ids, batch.temperature, loss_mask=mb.loss_mask,
                                  images=mb.images)
            gaps.append((lp - mb.inference_logprobs)[mb.loss_mask].abs())
    return float(torch.cat(gaps).mean())


RELOAD = {"lora": ["--orch.weight_broadcast.reload", "lora"],
          "merged": ["--orch.weight_broadcast.reload", "merged", "--train.broadcast_merged", "true",
                     "--infer.weight_reload", "true"],
          "full": ["--train.lora", "false"]}  # full fine-tuning (vision tower included): merged reloads on CPU


@pytest.mark.slow  # whole runs: make test-all (the VLM trainer's float64 tests stay in the default suite)
@pytest.mark.parametrize("reload", ["lora", "merged", "full"])
def test_vlm_grpo_run_agrees_with_vllm(tmp_path, reload):
    model = build_tiny_vlm(tmp_path / "tiny-vlm")
    run_dir, port = tmp_path / "run", free_port()
    env = json.dumps([{"id": "tests.e2e.vlm_env:SquareColour", "args": {"image_dir": str(tmp_path / "images")}}])
    proc = tidal("grpo", "--model", str(model), "--output-dir", str(run_dir), "--infer.port", str(port),
                 "--orch.max_steps", "2", "--orch.max_async_level", "0", *RELOAD[reload],
                 *ORCH_SMALL, "--orch.env", env,
                 "--orch.eval", "{env: [{id: visual-shapes, name: shapes, args: {image_size: 32}}], num_examples: 4, "
                 "rollouts_per_example: 2, interval: 1}")
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["mismatch_kl"] <= 1e-3 for r in rows), [r["mismatch_kl"] for r in rows]
    assert all(r["off_policy_level"] == 0 for r in rows), "step 2 was sampled with the trained policy"
    assert rows[0]["grad_norm"] > 0, "rewards differed, the policy got a gradient"
    batches = [TrainingBatch.load(run_dir / "rollouts" / f"step_{n}.safetensors") for n in (1, 2)]
    batch = batches[0]
    assert batch.has_images and len(batch.image_lengths) == 4, "4 prompts, one distinct image each"
    for i, s in enumerate(batch.samples()):
        prompt = batch.tokens[s][:batch.prompt_lengths[i]]
        assert np.count_nonzero(prompt == IMAGE_TOKEN_ID) == TOKENS_PER_IMAGE, "vLLM expanded the placeholder"
        assert not batch.loss_mask[s][:batch.prompt_lengths[i]].any()
    assert base_model_gap(model, batches[0]) < 1e-4, "step 1: vLLM served the base model, with the images"
    assert base_model_gap(model, batches[1]) > 1e-2, "step 2: vLLM served the trained policy, not the base"
    evals = read_metrics(run_dir / "eval.jsonl")
    assert evals and all(e["eval/shapes/examples"] == 4 for e in evals), "the bundled visual-shapes evaluates"
    if reload == "full":
        assert (run_dir / "final" / "model").is_dir()
        return
    (adapter,) = (run_dir / "final" / "adapter").glob("*.safetensors")
    with safe_open(str(adapter), "np") as f:
        keys = list(f.keys())
    assert keys and all(".text_model." in k for k in keys), keys[:4]
