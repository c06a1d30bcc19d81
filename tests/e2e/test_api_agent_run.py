"""`GRPOTrainer(agent=...)` for real (vLLM + trainer subprocesses, the orchestrator and the agent program in the
script's process): a closure on the stock `openai` SDK runs the 3-turn tool conversation of `tests.e2e.agent_env`
once per rollout against its session, its return value is the reward, and every trained token is a sampled one
(`bf16=False`: float32 training, so mismatch_kl is at the float32 level; with TRL's default bf16 autocast on CPU
it was 2.1e-4)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO, free_port, kill_group
from tests.e2e.agent_env import calling_tool_model
from tidal.monitor.metrics import read_metrics

pytestmark = pytest.mark.vllm

SCRIPT = """
import json, sys
import openai
from peft import LoraConfig
from tidal import GRPOConfig, GRPOTrainer
from tests.e2e.agent_env import openai_turns

rows = [{"prompt": [{"role": "system", "content": "Reverse the text inside the tags."},
                    {"role": "user", "content": t}], "answer": t[::-1], "text": t}
        for t in ("ab cd", "hello", "xyz w", "tidal")]
seen = []

def agent(base_url, api_key, example):  # a closure over `seen`: called in this process
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = openai_turns(client, example)
    seen.append(sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "tool"))
    return 1.0 if seen[-1] else 0.0

args = GRPOConfig(output_dir=sys.argv[2], num_generations=4, per_device_train_batch_size=8, max_steps=1,
                  max_completion_length=48, max_prompt_length=464, learning_rate=1e-3, logging_steps=1,
                  save_strategy="no", vllm_server_port=int(sys.argv[3]), seed=0, bf16=False)
trainer = GRPOTrainer(model=sys.argv[1], args=args, train_dataset=rows,
                      agent={"function": agent, "tool_prompt": "program"},
                      peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
out = trainer.train()
print("RESULT " + json.dumps({"step": out.global_step, "sessions": len(seen)}))
"""


@pytest.mark.slow  # a whole GRPOTrainer run (~2 min on 2 shared cores); the agent env's default run: test_agent_run
def test_an_agent_closure_trains_through_grpo_trainer(tmp_path):
    model = calling_tool_model(tmp_path / "model")
    script = tmp_path / "train_agent.py"
    script.write_text(textwrap.dedent(SCRIPT))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(script), str(model), str(run_dir), str(free_port())], cwd=REPO,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert result == {"step": 1, "sessions": 8}, "one session per rollout, the closure run in the script's process"
    rows = read_metrics(run_dir / "metrics.jsonl")
    r = rows[0]
    print("api agent run:", {k: r[k] for k in r if k.startswith(("agent/", "reward/")) or k == "mismatch_kl"})
    assert r["agent/sessions"] == 8 and r["agent/calls"] == 24 and r["agent/failures"] == 0
    assert "reward/agent/mean" in r, "the program's return value is the reward column"
    assert r["off_policy_level"] == 0 and r["mismatch_kl"] < 1e-8, r["mismatch_kl"]
