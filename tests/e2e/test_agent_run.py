"""A stock `openai`-SDK agent program trains through `tidal grpo` (the `agent` environment, `tidal.envs.agent`): the
program (`python -m tests.e2e.agent_env`: three turns, a tool round trip when the model calls the tool) runs once per
rollout against its session's base URL; the batches hold its sessions' rows, tool turns spliced in with no loss, and
trainer and inference agree on every trained token (mismatch_kl at the float32 level on on-policy steps)."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import free_port, kill_group, tidal
from tests.e2e.agent_env import calling_tool_model
from tests.e2e.test_tool_run import tool_turns_of
from tidal.monitor.metrics import read_metrics
from tidal.transport.batch import TrainingBatch

pytestmark = pytest.mark.vllm


def test_openai_sdk_agent_trains_through_tidal_grpo(tmp_path):
    from tidal.trainer.model.load import load_tokenizer

    model = calling_tool_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    env = ("[{id: agent, args: {command: [" + sys.executable + ", -m, tests.e2e.agent_env], "
           "task: {id: reverse-text}, timeout_s: 120}}]")
    proc = tidal("grpo", "--model", str(model), "--output-dir", str(run_dir), "--infer.port", str(free_port()),
                 "--orch.max_steps", "2", "--orch.env", env, "--orch.batch_size", "8",
                 "--orch.rollouts_per_example", "4", "--orch.sampling.max_tokens", "48", "--orch.seq_len", "512",
                 "--train.sequence_len", "512")
    try:
        out, _ = proc.communicate(timeout=1500)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    print("agent run:", [{k: r[k] for k in r if k.startswith("agent/") or k in ("step", "mismatch_kl", "reward/mean")}
                         for r in rows])
    for r in rows:
        assert r["agent/sessions"] >= 8 and r["agent/calls"] == 3 * r["agent/sessions"], r
        assert r["agent/failures"] == 0, r
        # a turn cut at max_tokens makes the next call a fork (counted); the rows are then the calls' chains
        assert r["agent/rows"] == r["agent/sessions"] + r["agent/forks"], r
    assert rows[0]["mismatch_kl"] < 1e-6, rows[0]["mismatch_kl"]  # step 1 is on-policy: every trained token sampled
    batch = TrainingBatch.load(run_dir / "rollouts" / "step_1.safetensors")
    turns = tool_turns_of(batch, load_tokenizer(str(model)))
    assert len(turns) >= len(batch.samples()), "spliced turns (tool result or user message) between model turns"
    assert any(t.startswith("<|im_end|>\n<|im_start|>tool\n") or "<|im_start|>tool\n" in t for t in turns), turns[:4]
    assert all(t.endswith("<|im_end|>\n<|im_start|>assistant\n") for t in turns), turns[:4]


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
