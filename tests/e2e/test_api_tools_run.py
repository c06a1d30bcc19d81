"""`GRPOTrainer(tools=..., environment_factory=...)` for real (vLLM + trainer subprocesses, the orchestrator and the
tools in the script's process): reset gets each example's columns, every rollout has its own environment instance,
reward functions get the rollout's messages (assistant turns with tool_calls, tool results) and `environments`,
`get_reward` is a reward column named after the class, and `max_tool_calling_iterations` caps the rounds. The model
is the renamed-tag copy of the bundled model (`tests.e2e.tool_env.tagged_tool_model`), whose `<tool_call>` blocks do
not parse: each comes back as an error tool message."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO, free_port, kill_group
from tests.e2e.tool_env import tagged_tool_model
from tidal.monitor.metrics import read_metrics

pytestmark = pytest.mark.vllm

SCRIPT = """
import json, sys
from peft import LoraConfig
from tidal import GRPOConfig, GRPOTrainer

rows = [{"prompt": [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": t}],
         "answer": t[::-1]} for t in ("ab cd", "hello", "xyz w", "tidal", "qrs", "mn op")]
seen = {"resets": [], "roles": set(), "envs": 0, "same_instance": 0}

def reverse(text: str) -> str:
    \"\"\"Reverse a text.

    Args:
        text: the text to reverse
    \"\"\"
    return text[::-1]

class Scratchpad:
    def reset(self, answer, **row):
        seen["resets"].append(answer)
        self.answer, self.notes = answer, []

    def note(self, text: str) -> str:
        \"\"\"Write a note.

        Args:
            text: the note
        \"\"\"
        self.notes.append(text)
        return "noted"

    def get_reward(self) -> float:
        return 0.25

def tool_turns(completions, environments, answer, **kwargs):
    for msgs, env, a in zip(completions, environments, answer):
        seen["roles"].update(m["role"] for m in msgs)
        seen["envs"] += isinstance(env, Scratchpad)
        seen["same_instance"] += env.answer == a
    return [float(sum(m["role"] == "tool" for m in msgs)) for msgs in completions]

args = GRPOConfig(output_dir=sys.argv[2], num_generations=4, per_device_train_batch_size=8, max_steps=2,
                  max_completion_length=160, max_prompt_length=64, learning_rate=1e-3, logging_steps=1,
                  save_strategy="no", vllm_server_port=int(sys.argv[3]), seed=0, max_tool_calling_iterations=1)
trainer = GRPOTrainer(model=sys.argv[1], reward_funcs=[tool_turns], args=args, train_dataset=rows,
                      tools=[reverse], environment_factory=Scratchpad,
                      peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
out = trainer.train()
print("RESULT " + json.dumps({"step": out.global_step, "resets": len(seen["resets"]), "roles": sorted(seen["roles"]),
                              "envs": seen["envs"], "same": seen["same_instance"]}))
"""


@pytest.mark.slow  # default suite budget: the tool loop runs in test_tool_run.py, the API in test_api_run.py
def test_tools_and_environment_factory_through_the_python_api(tmp_path):
    model = tagged_tool_model(tmp_path / "model")
    script = tmp_path / "train_tools.py"
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
    assert result["step"] == 2
    assert result["resets"] == 2 * 8, "one environment instance reset per rollout"
    assert result["roles"] == ["assistant", "tool"], "completions are the rollout's messages"
    assert result["envs"] == result["same"] == 2 * 8, "each rollout's own instance, reset with its row"
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert all(r["reward/Scratchpad/mean"] == pytest.approx(0.25) for r in rows), "get_reward is a reward column"
    assert all(0 < r["reward/tool_turns/mean"] <= 1 for r in rows), "tool turns happen, at most one round each"
    assert rows[0]["mismatch_kl"] < 1e-3
