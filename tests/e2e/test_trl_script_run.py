"""Issue 53's TRL user script, with only `from trl import ...` changed, on the bundled model: `use_cpu`, `seed=0`
(seeded vLLM sampling), `per_device_train_batch_size=64`, `num_generations=8`, a tokenizer as `processing_class`,
a LoRA `peft_config`, `bf16=False`, and a `TrainerCallback` that logs and stops the run at step 1 of 4. The run
ends cleanly, the callback saw TRL's events and metric names, and the stop cut the run short (the orchestrator
finishes the batch it is writing: 2 or 3 steps, never the 4 of max_steps)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO, free_port, kill_group
from tidal.monitor.metrics import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # a whole run at a realistic batch: make test-all

SCRIPT = """
import json, random, sys
from peft import LoraConfig
from transformers import AutoTokenizer, TrainerCallback
from tidal import GRPOConfig, GRPOTrainer   # was: from trl import GRPOConfig, GRPOTrainer
from tidal.models.sources import resolve_model      # the bundled model's directory (a TRL script names a Hub id)

rng = random.Random(0)
rows = []
for _ in range(200):
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)})

def correct(completions, answer, **kwargs):
    return [1.0 if a in c[0]["content"] else 0.0 for c, a in zip(completions, answer)]

class Watch(TrainerCallback):
    events, logs = [], []
    def on_train_begin(self, args, state, control, **kw): self.events.append("train_begin")
    def on_step_end(self, args, state, control, **kw):
        self.events.append(f"step_end {state.global_step}")
        control.should_training_stop = state.global_step >= 1   # early stopping, as TRL scripts do
    def on_log(self, args, state, control, logs=None, **kw): self.logs.append(logs)
    def on_save(self, args, state, control, **kw): self.events.append(f"save {state.global_step}")
    def on_train_end(self, args, state, control, **kw): self.events.append(f"train_end {state.global_step}")

model = "tidal:tiny-reverse"
tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
args = GRPOConfig(output_dir=sys.argv[1], use_cpu=True, seed=0, per_device_train_batch_size=64, num_generations=8,
                  max_completion_length=32, max_prompt_length=64, learning_rate=1e-5, logging_steps=1,
                  max_steps=4, save_strategy="steps", save_steps=1, bf16=False, vllm_server_port=int(sys.argv[2]))
trainer = GRPOTrainer(model=model, reward_funcs=correct, args=args, train_dataset=rows, processing_class=tokenizer,
                      callbacks=[Watch()], peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
out = trainer.train()
print("RESULT " + json.dumps({"step": out.global_step, "events": Watch.events, "logs": Watch.logs}))
"""


def test_the_issue_53_trl_script_runs_seeded_with_callbacks_and_stops(tmp_path):
    script = tmp_path / "train_grpo.py"
    script.write_text(textwrap.dedent(SCRIPT))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(script), str(run_dir), str(free_port())], cwd=REPO,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "does not use offset" not in (run_dir / "logs" / "infer.log").read_text(), "no seeded-sampling crash"
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, result["step"] + 1)) and 1 <= result["step"] < 4, "stopped before max_steps"
    events = result["events"]
    assert events[0] == "train_begin" and events[-1] == f"train_end {result['step']}"
    assert [e for e in events if e.startswith("step_end")] == [f"step_end {n}" for n in steps]
    assert "save 1" in events, "save_steps=1: step 1's checkpoint"
    assert len(result["logs"]) == len(steps)
    assert all({"reward", "reward_std", "rewards/correct/mean", "loss", "learning_rate", "completions/mean_length"}
               <= set(logs) for logs in result["logs"])
    orch = (run_dir / "configs" / "orch.yaml").read_text()
    # TRL counts completions: per_device_train_batch_size 64 = 8 prompts x 8 generations per batch
    assert "\nseed: 0" in orch and "\nbatch_size: 64" in orch and "\nrollouts_per_example: 8" in orch
