"""A real run (bundled model, real vLLM) with batches over the zmq transport instead of files."""

from __future__ import annotations

import pytest

from tests.conftest import free_port, kill_group, tidal
from tests.e2e.test_grpo_runs import check_metrics, small

pytestmark = pytest.mark.vllm


def test_colocate_run_over_zmq(tmp_path):
    run_dir, port, zport = tmp_path / "run", free_port(), free_port()
    proc = tidal("grpo", "--output-dir", str(run_dir), "--infer.port", str(port), *small(),
                 "--orch.rollout_transport.type", "zmq", "--orch.rollout_transport.port", str(zport),
                 "--orch.rollout_transport.hwm", "2")
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    check_metrics(run_dir, 3)
    assert not list((run_dir / "rollouts").glob("step_*.safetensors")), "no batch went through the filesystem"
    assert "transport_type: zmq" in (run_dir / "configs" / "train.yaml").read_text()
