"""A real co-locate run (bundled model, real vLLM) with neither batches nor weights going through files:
batches over the zmq transport, and `weight_broadcast.type: nccl` (the trainer pushes each policy into vLLM's
workers through vLLM's weight-transfer engine; gloo on this CPU machine). The inference server is SIGKILLed
mid-run: the launcher restarts it, the orchestrator sees it serve the base weights and asks the trainer to
push the current policy again. (One run for both transports keeps the default suite short.)"""

from __future__ import annotations

import signal

import pytest

from tests.conftest import free_port, kill_group, tidal
from tests.e2e.test_grpo_runs import check_metrics, small
from tests.e2e.test_resume_runs import vllm_server_process, wait_steps

pytestmark = pytest.mark.vllm


@pytest.mark.slow  # a whole run: make test-all (the default suite keeps the bundled run, ctrl-c, API)
def test_colocate_run_over_zmq_with_pushed_weights_survives_an_inference_restart(tmp_path):
    run_dir, port, steps = tmp_path / "run", free_port(), 6
    proc = tidal("grpo", "--output-dir", str(run_dir), "--infer.port", str(port), *small(steps),
                 "--orch.rollout_transport.type", "zmq", "--orch.rollout_transport.port", str(free_port()),
                 "--orch.rollout_transport.hwm", "2",
                 "--orch.weight_broadcast.type", "nccl", "--orch.weight_broadcast.port", str(free_port()),
                 "--orch.weight_broadcast.timeout", "120", "--orch.max_async_level", "0")
    try:
        wait_steps(run_dir, 2, [proc])
        vllm_server_process(proc.pid).send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "restarting it (1 of 3)" in out
    rows = check_metrics(run_dir, steps)
    assert sum(1 for r in rows if r["push_time_s"] > 0) >= steps - 1, "policies are pushed"
    # max_async_level 0: every step samples the policy the trainer holds, and vLLM served exactly it; a missing
    # or wrong push (e.g. the restarted server left on base weights under a policy label) would show here
    assert [r["policy_step"] for r in rows] == list(range(steps))
    assert all(abs(r["mismatch_kl"]) < 1e-6 for r in rows), [(r["step"], r["mismatch_kl"]) for r in rows]
    orch_log = (run_dir / "logs/orch.log").read_text()
    train_log = (run_dir / "logs/train.log").read_text()
    assert "asking the trainer to push it again" in orch_log and "pushed policy" in train_log
    assert "weight broadcast group open" in train_log
    train_cfg = (run_dir / "configs" / "train.yaml").read_text()
    assert "type: nccl" in train_cfg and "broadcast_merged: false" in train_cfg
    assert "weight_broadcast_type: nccl" in (run_dir / "configs" / "infer.yaml").read_text()
    assert not list(run_dir.glob("broadcasts/step_*/merged")), "no full weights went through the filesystem"
    assert not list((run_dir / "rollouts").glob("step_*.safetensors")), "no batch went through the filesystem"
    assert "transport_type: zmq" in train_cfg
