"""`from tidal import GRPOConfig, GRPOTrainer`: a TRL-shaped script trains for real (vLLM + trainer subprocesses,
the orchestrator in the script's process) with a local jsonl dataset, a closure and a lambda as rewards, a
peft LoraConfig and an eval dataset of standard (plain-text) prompts; then nothing it started is left running."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO, free_port, kill_group
from tidal.monitor.metrics import read_metrics

pytestmark = pytest.mark.vllm

SCRIPT = """
import json, sys
from datasets import load_dataset
from peft import LoraConfig
from tidal import GRPOConfig, GRPOTrainer

train = load_dataset("json", data_files=sys.argv[1], split="train")
evals = [{"prompt": "Reverse: abc", "answer": "cba"}, {"prompt": "Reverse: de fg", "answer": "gf ed"}]
calls = []

def make_reward(target):
    def reward_close(completions, **kwargs):  # a closure: state lives in this process
        calls.append(len(completions))
        return [-abs(target - len(c[0]["content"] if isinstance(c, list) else c)) / 10 for c in completions]
    return reward_close

args = GRPOConfig(output_dir=sys.argv[2], num_generations=4, per_device_train_batch_size=8, max_steps=2,
                  max_completion_length=16, max_prompt_length=64, learning_rate=1e-3, logging_steps=1,
                  save_strategy="no", vllm_server_port=int(sys.argv[3]), seed=0, eval_strategy="steps",
                  eval_steps=1, reward_weights=[1.0, 0.5])
trainer = GRPOTrainer(
    model="tidal:tiny-reverse",
    reward_funcs=[make_reward(8), lambda completions, answer, **kw: [float(a[:2] in str(c)) for c, a in
                                                                     zip(completions, answer)]],
    args=args, train_dataset=train, eval_dataset=evals,
    peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
out = trainer.train()
saved = trainer.save_model(sys.argv[2] + "-adapter")
print("RESULT " + json.dumps({"step": out.global_step, "calls": sum(calls), "run_dir": str(out.run_dir)}))
"""


def test_trl_shaped_script_trains_with_closures_and_leaves_nothing_running(tmp_path):
    import psutil

    rows = [{"prompt": [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": t}],
             "answer": t[::-1]} for t in ("ab cd", "hello", "xyz w", "tidal", "qrs", "mn op")]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    script = tmp_path / "train_grpo.py"
    script.write_text(textwrap.dedent(SCRIPT))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(script), str(data), str(run_dir), str(free_port())], cwd=REPO,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert result["step"] == 2 and result["calls"] >= 2 * 8, "the closure ran in the script's process"
    assert (tmp_path / "run-adapter" / "adapter_model.safetensors").is_file(), "save_model copies the adapter"
    rows_m = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows_m] == [1, 2]
    assert all("reward/reward_close/mean" in r and "reward/<lambda>/mean" in r for r in rows_m)
    assert all(r["loss"] == r["loss"] and r["tokens"] > 0 for r in rows_m)
    evals = read_metrics(run_dir / "eval.jsonl")
    assert evals and all(e["eval/eval/examples"] == 2 for e in evals)
    orch_yaml = (run_dir / "configs/orch.yaml").read_text()
    assert "id: dataset" in orch_yaml and "rollouts_per_example: 4" in orch_yaml
    assert "lora_rank: 8" in (run_dir / "configs/train.yaml").read_text()
    assert (run_dir / "logs/orch.log").read_text().count("batch") >= 2
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if str(run_dir) in " ".join(p.info["cmdline"] or []) and p.pid != proc.pid]
    assert not leftovers, [p.info["cmdline"] for p in leftovers]
