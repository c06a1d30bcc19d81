"""`GRPOTrainer(rollout_func=...)` trains for real: a TRL-shaped script's rollout function samples through tidal's
vLLM server (`generate_rollout_completions`), cuts each completion to its first 3 tokens and returns a field the
reward function reads; the run trains on the returned tokens (every completion at most 3 tokens, where the server
was allowed 16) and scores with the field (the reward, the field, equals the lengths tidal measured); evaluation
samples through it too."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO, free_port, kill_group
from tidal.monitor.metrics import read_metrics

# a whole run (slow); the hook's parts run by default in tests/integration/test_rollout_func.py
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = """
import json, sys
from peft import LoraConfig
from tidal import GRPOConfig, GRPOTrainer, generate_rollout_completions

rows = [{"prompt": [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": t}]}
        for t in ("ab cd", "hello", "xyz w", "tidal", "qrs", "mn op")]
calls = []

def rollout_func(prompts, trainer):
    assert trainer.args.max_completion_length == 16 and len(prompts) == trainer.num_generations
    outs = generate_rollout_completions(trainer, prompts)
    cut = [o["completion_ids"][:3] for o in outs]
    return {"prompt_ids": [o["prompt_ids"] for o in outs], "completion_ids": cut,
            "logprobs": [o["logprobs"][:len(c)] for o, c in zip(outs, cut)], "n_tokens": [len(c) for c in cut]}

def from_field(completions, completion_ids, n_tokens, **kwargs):
    assert n_tokens == [len(c) for c in completion_ids], (n_tokens, completion_ids)
    calls.append(len(n_tokens))
    return [float(n) for n in n_tokens]

args = GRPOConfig(output_dir=sys.argv[1], num_generations=4, per_device_train_batch_size=8, max_steps=2,
                  max_completion_length=16, max_prompt_length=64, learning_rate=1e-3, logging_steps=1,
                  save_strategy="no", vllm_server_port=int(sys.argv[2]), seed=0, eval_strategy="steps",
                  eval_steps=1)
trainer = GRPOTrainer(model="tidal:tiny-reverse", reward_funcs=from_field, args=args, train_dataset=rows,
                      eval_dataset=rows[:2],
                      rollout_func=rollout_func,
                      peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
out = trainer.train()
print("RESULT " + json.dumps({"step": out.global_step, "calls": sum(calls)}))
"""


def test_rollout_func_run_trains_on_the_returned_tokens_and_scores_its_field(tmp_path):
    script = tmp_path / "train_grpo.py"
    script.write_text(textwrap.dedent(SCRIPT))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(script), str(run_dir), str(free_port())], cwd=REPO,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert result["step"] == 2 and result["calls"] >= 2 * 8
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 1 <= r["completions/max_length"] <= 3, "the returned (cut) tokens are what the batch holds"
        assert r["reward/from_field/mean"] == pytest.approx(r["completions/mean_length"])
        assert r["loss"] == r["loss"] and r["tokens"] > 0
    evals = read_metrics(run_dir / "eval.jsonl")
    assert evals and all(1 <= e["eval/eval/completion_len/mean"] <= 3 for e in evals), "eval samples through it too"
