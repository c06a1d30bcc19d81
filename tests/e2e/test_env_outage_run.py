"""An environment outage in a real run is waited out, never trained on: `tidal grpo` (real vLLM, the bundled model)
against a real OpenEnv server on localhost (`tests.e2e.openenv_reverse`, openenv-core's `create_app` under uvicorn,
multi-turn episodes). Once batch 2 is written the test kills the server; the orchestrator's next step finds its
episodes failed on the environment's side (refused connections, placeholder prompts), says so once naming the
server's URL, waits with backoff; the test restarts the server on the same port once the warning is out, and the
run goes on: every step is trained once (1..max_steps), both components' checkpoints are written, no batch holds a
rollout the environment did not judge with loss weight (env/failed <= samples without loss), and the waits are
counted (env/outage_waits)."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("openenv.core", reason="openenv-core is the optional `openenv` extra: pip install 'tidal[openenv]'")

from tests.conftest import free_port, kill_group, tidal  # noqa: E402
from tests.e2e.test_openenv_run import serve_openenv  # noqa: E402
from tidal.monitor.metrics import read_metrics  # noqa: E402
from tidal.paths import ckpt_dir  # noqa: E402
from tidal.transport.batch import TrainingBatch  # noqa: E402

pytestmark = pytest.mark.vllm

STEPS = 4


def wait_for(cond, proc, log, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert proc.poll() is None, f"the run ended before {what}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)


@pytest.mark.slow  # a whole run (~50-90 s on 2 cores): make test-all; the outage rules: tests/unit/test_env_outage.py
def test_env_server_killed_and_restarted_mid_run_is_an_outage_waited_out(tmp_path):
    env_port, run_dir, log = free_port(), tmp_path / "run", tmp_path / "grpo.log"
    url = f"http://127.0.0.1:{env_port}"
    server = serve_openenv(env_port)
    args = f"{{base_url: '{url}', max_turns: 2, system_prompt: 'Reverse the text.', max_sessions: 8, timeout_s: 10}}"
    with open(log, "w") as f:
        proc = tidal("grpo", "--output-dir", str(run_dir), "--infer.port", str(free_port()), "--orch.max_steps",
                     str(STEPS), "--orch.batch_size", "8", "--orch.rollouts_per_example", "4",
                     "--orch.sampling.max_tokens", "48", "--orch.sampling.seed", "7", "--orch.env_outage.timeout_s",
                     "300", "--orch.ckpt.interval", "2", "--train.ckpt.interval", "2", "--orch.env",
                     f"[{{id: 'tidal.envs.openenv:OpenEnv', args: {args}}}]", stdout=f)
    try:
        wait_for((run_dir / "rollouts" / "step_2.safetensors").exists, proc, log, 600, "batch 2")
        kill_group(server)  # the environment goes away mid-run
        wait_for(lambda: "environment outage:" in log.read_text(), proc, log, 180, "outage warning")
        time.sleep(3)  # a backoff wait or two with the server still down
        server = serve_openenv(env_port)  # back on the same port
        proc.wait(timeout=600)
    finally:
        kill_group(proc)
        kill_group(server)
    out = log.read_text()
    assert proc.returncode == 0, out[-4000:]
    assert out.count("environment outage:") == 1, "said once"
    warning = out[out.index("environment outage:"):][:800]
    assert f"OpenEnv environment at {url}" in warning and "rollouts failed on the environment's side" in warning
    assert "environment outage over after" in out
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "every step trained once, none on the outage"
    assert sum(r["env/outage_waits"] for r in rows) >= 1
    for r in rows:
        b = TrainingBatch.load(run_dir / "rollouts" / f"step_{r['step']}.safetensors")
        no_loss = sum(int(b.loss_mask[s].sum() == 0) for s in b.samples())
        assert r["env/failed"] <= no_loss, (r["step"], r["env/failed"], no_loss)
        assert r["env/failed"] < 0.5 * b.num_samples, "a batch mostly failed would have been an outage"
        assert np.isfinite(r["loss"]) and r["reward/mean"] is not None
    for component in ("trainer", "orch"):
        for step in (2, 4):
            assert (ckpt_dir(run_dir, component, step) / "STABLE").exists(), (component, step)
