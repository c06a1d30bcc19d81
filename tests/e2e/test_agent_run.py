"""Stock agent programs train through `tidal grpo` (the `agent` environment, `tidal.envs.agent`): the program
(`python -m tests.e2e.agent_env`: three turns, a tool round trip when the model calls the tool; on the `openai` SDK with
a forked side call, or on the `anthropic` SDK) runs once per rollout against its session's base URL; the batches hold
every row of its sessions (forks included), tool turns spliced in with no loss, and trainer and inference agree on
every trained token (mismatch_kl at the float32 level on on-policy steps). `--resume` continues an agent run."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import free_port, kill_group, tidal
from tests.e2e.agent_env import calling_tool_model
from tests.e2e.test_tool_run import tool_turns_of
from tidal.monitor.metrics import read_metrics
from tidal.transport.batch import TrainingBatch

pytestmark = pytest.mark.vllm


def agent_run(model, run_dir, program: str, steps: int, *more: str) -> tuple[str, list[dict]]:
    """`tidal grpo` of `python -m tests.e2e.agent_env PROGRAM` (8 sessions a step, 4 per example) for `steps` steps;
    (its output, its metrics rows), after checking that it exited 0."""
    env = ("[{id: agent, args: {command: [" + sys.executable + ", -m, tests.e2e.agent_env, " + program + "], "
           "task: {id: reverse-text}, timeout_s: 120, tool_prompt: program}}]")
    proc = tidal("grpo", "--model", str(model), "--output-dir", str(run_dir), "--infer.port", str(free_port()),
                 "--orch.max_steps", str(steps), "--orch.env", env, "--orch.batch_size", "8",
                 "--orch.rollouts_per_example", "4", "--orch.sampling.max_tokens", "48", "--orch.seq_len", "512",
                 "--train.sequence_len", "512", *more)
    try:
        out, _ = proc.communicate(timeout=1500)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    print("agent run:", [{k: r[k] for k in r if k.startswith("agent/") or k in (
        "step", "samples", "mismatch_kl", "off_policy_level", "reward/mean")} for r in rows])
    return out, rows


def check_steps(rows: list[dict], calls_per_session: int) -> None:
    """Every session made its calls and none failed; every row was trained (a step's samples are its sessions'
    rows); every on-policy step trained exactly the sampled tokens (mismatch_kl at the float32 level)."""
    for r in rows:
        assert r["agent/sessions"] >= 8 and r["agent/calls"] == calls_per_session * r["agent/sessions"], r
        assert r["agent/failures"] == 0, r
        # a turn cut at max_tokens makes the next call a fork (counted); the rows are then the calls' chains
        assert r["agent/rows"] == r["agent/sessions"] + r["agent/forks"], r
        if r["agent/sessions"] == 8:
            assert r["samples"] == r["agent/rows"], "every row of every session is a sample of the batch"
        if r["off_policy_level"] == 0:
            assert r["mismatch_kl"] < 1e-8, r["mismatch_kl"]


def test_openai_sdk_agent_with_a_fork_trains_through_tidal_grpo(tmp_path):
    """The stock `openai`-SDK program: 3 turns with tool calls, then a side call with a rewritten history (a fork):
    both rows of every session are trained, every trained token a sampled one."""
    from tidal.trainer.model.load import load_tokenizer

    model = calling_tool_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    _, rows = agent_run(model, run_dir, "fork", 2)
    assert [r["step"] for r in rows] == [1, 2]
    check_steps(rows, 4)
    assert all(r["agent/forks"] >= r["agent/sessions"] for r in rows), "the side call of every session forks"
    assert rows[0]["off_policy_level"] == 0, "step 1 is on-policy"
    batch = TrainingBatch.load(run_dir / "rollouts" / "step_1.safetensors")
    assert batch.num_samples >= 16, "a session's 3-turn row and its side call's row"
    turns = tool_turns_of(batch, load_tokenizer(str(model)))
    assert len(turns) >= 8, "spliced turns (tool result or user message) between model turns"
    assert any(t.startswith("<|im_end|>\n<|im_start|>tool\n") or "<|im_start|>tool\n" in t for t in turns), turns[:4]
    assert all(t.endswith("<|im_end|>\n<|im_start|>assistant\n") for t in turns), turns[:4]


@pytest.mark.slow  # two `tidal grpo` runs (~3 min on 2 shared cores); the openai-SDK run above is the default one
def test_anthropic_sdk_agent_trains_and_resumes(tmp_path):
    """The stock `anthropic`-SDK program (3 turns, tool_use / tool_result rounds) trains 2 steps, checkpointing
    each; `tidal grpo --resume` continues it from step 2 to step 3."""
    model = calling_tool_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    ckpt = ("--orch.ckpt.interval", "1", "--train.ckpt.interval", "1")
    _, rows = agent_run(model, run_dir, "anthropic", 2, *ckpt)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["off_policy_level"] == 0
    check_steps(rows, 3)
    out, rows = agent_run(model, run_dir, "anthropic", 3, *ckpt, "--resume")
    assert "resumed from checkpoint step" in out, out[-3000:]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["resumed_from"] == 2, rows[2]
    check_steps(rows, 3)
    assert rows[2]["progress/total_samples"] > rows[1]["progress/total_samples"], "the orchestrator's progress went on"


def test_sigkill_of_the_launcher_leaves_no_agent_process(tmp_path):
    """Programs (and a process each starts) running when `tidal grpo` is SIGKILLed are gone shortly after: the
    orchestrator dies with its parent, each program with the orchestrator (parent-death signal), and the
    orchestrator's reaper takes the rest."""
    import os
    import signal
    import time

    pids = tmp_path / "pids"
    program = (f"import os, subprocess, time; p = subprocess.Popen(['sleep', '300']); "
               f"open({str(pids)!r}, 'a').write(f'{{os.getpid()}} {{p.pid}} '); time.sleep(300)")
    env = ("[{id: agent, args: {command: [" + sys.executable + ", -c, \"" + program.replace('"', '\\"') + "\"], "
           "task: {id: reverse-text}, timeout_s: 600}}]")
    proc = tidal("grpo", "--output-dir", str(tmp_path / "run"), "--infer.port", str(free_port()),
                 "--orch.max_steps", "1", "--orch.env", env, "--orch.batch_size", "4",
                 "--orch.rollouts_per_example", "2")
    try:
        deadline = time.monotonic() + 600
        while not (pids.exists() and len(pids.read_text().split()) >= 8):
            assert proc.poll() is None, proc.stdout.read()[-3000:] if proc.stdout else ""
            assert time.monotonic() < deadline, "the programs never started"
            time.sleep(1)
        time.sleep(1.5)  # the reaper scans descendants every 0.5 s
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        alive = [int(p) for p in pids.read_text().split()]
        deadline = time.monotonic() + 30
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if os.path.exists(f"/proc/{p}") and "Z" not in
                     open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[:1]]
            time.sleep(0.5)
        assert not alive, f"agent processes left: {alive}"
    finally:
        kill_group(proc)
