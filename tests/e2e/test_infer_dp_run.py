"""`tidal grpo --infer.dp 2`: co-locate with two real vLLM servers of the bundled model.

Both servers must answer completions (the orchestrator spreads requests over them), both must load every policy
the run samples with (CPU co-locate: the LoRA factors merged in place in each server's worker; or pushed by the
trainer with `weight_broadcast: nccl`, over gloo here), and nothing may be left running after the run. The run is
strictly on-policy (max_async_level 0), so a server left on an older policy would show as a mismatch_kl far above the
~1e-12 of fp32 noise. Each server's lines in `logs/infer.log` carry its `[dp{i}:{port}]` prefix, which is how
requests and reloads are counted per server.
"""

from __future__ import annotations

import re
import socket
import time

import pytest

from tests.conftest import kill_group, tidal
from tests.e2e.test_grpo_runs import ORCH_SMALL, alive, check_metrics, descendants
from tidal.transport.batch import TrainingBatch

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def free_port_pair() -> int:
    """A port p with p and p + 1 both free."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return int(port)
    raise RuntimeError("no two consecutive free ports")


def per_server(log: str, pattern: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for m in re.finditer(rf"^\[(dp\d+):\d+\] .*{pattern}", log, flags=re.M):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


@pytest.mark.parametrize("broadcast", ["factors", "nccl"])  # factors: the CPU default, merged in each worker
def test_colocate_with_two_inference_servers(tmp_path, broadcast):
    run_dir, port, steps = tmp_path / "run", free_port_pair(), 3
    nccl = ["--orch.weight_broadcast.type", "nccl"] if broadcast == "nccl" else []
    proc = tidal("grpo", "--output-dir", str(run_dir), "--infer.port", str(port), "--infer.dp", "2",
                 "--orch.max_steps", str(steps), "--orch.max_async_level", "0", *ORCH_SMALL,
                 "--train.max_async_level", "0", *nccl)
    family: list = []
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None:
            log = run_dir / "logs" / "infer.log"
            if log.is_file() and "all 2 vLLM servers ready" in log.read_text(errors="replace"):
                family = descendants(proc.pid)  # launcher's children, both servers, their engines, reapers
                break
            time.sleep(0.5)
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    assert len(family) >= 6, [p.cmdline() for p in family]
    rows = check_metrics(run_dir, steps)
    assert all(abs(r["mismatch_kl"]) < 1e-8 for r in rows), [r["mismatch_kl"] for r in rows]
    orch_yaml = (run_dir / "configs" / "orch.yaml").read_text()
    assert f"http://127.0.0.1:{port}/v1" in orch_yaml and f"http://127.0.0.1:{port + 1}/v1" in orch_yaml

    log = (run_dir / "logs" / "infer.log").read_text(errors="replace")
    completions = per_server(log, r'"POST /v1/completions HTTP/1.1" 200')
    assert set(completions) == {"dp0", "dp1"} and min(completions.values()) >= 2, completions
    # every policy a batch was sampled with was reloaded into both servers (strictly on-policy: 1 .. steps-1)
    used = {int(s) for k in range(1, steps + 1)
            for s in TrainingBatch.load(run_dir / "rollouts" / f"step_{k}.safetensors").policy_steps}
    assert used == set(range(steps)), used
    if broadcast == "factors":  # one /collective_rpc tidal_merge_lora per policy and server
        reloads = per_server(log, r'"POST /collective_rpc HTTP/1.1" 200')
        assert reloads == {"dp0": steps - 1, "dp1": steps - 1}, reloads
    else:  # the trainer pushes every step's policy (the last one too) into both servers
        pushes = per_server(log, r'"POST /update_weights HTTP/1.1" 200')
        assert pushes == {"dp0": steps, "dp1": steps}, pushes
    assert len(re.findall(r"policy \d+ served by 2 inference server\(s\)", out)) == steps - 1

    time.sleep(1)
    left = alive(family)
    assert not left, f"left running: {[p.cmdline() for p in left]}"
    for p in (port, port + 1):
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", p), timeout=1)
