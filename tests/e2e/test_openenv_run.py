"""An OpenEnv environment trained end to end: the test starts a small OpenEnv server on localhost (`tests.e2e.
openenv_reverse`, written with openenv-core's `create_app`, served by uvicorn; no containers) and `tidal grpo` trains
two steps against it with real vLLM and the bundled model. Episodes are multi-turn (the server's feedback comes back
as a user message spliced in as tokens with no loss, the model continues from the exact token ids) and the server
fails the episodes of every other example at their first step on purpose, charged to the environment
(`action_failures: environment`; by default a step failing while the server stays healthy is the model's): those
are not judged (a failure on the environment's side: no loss, their groups dropped and counted in
`env/dropped_groups`; `env_outage.fraction` 1 keeps half a step failed from being an outage), and the run
finishes."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

pytest.importorskip("openenv.core", reason="openenv-core is the optional `openenv` extra: pip install 'tidal[openenv]'")

from tests.conftest import free_port, kill_group, tidal  # noqa: E402
from tidal.monitor.metrics import read_metrics  # noqa: E402
from tidal.transport.batch import TrainingBatch  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # 80-120 s on 2 busy cores (vLLM start, two steps of two-turn
# episodes): `make test-all`; the default suite keeps tests/unit/test_openenv.py (a real server, the real tool loop)


def serve_openenv(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "tests.e2e.openenv_reverse:app", "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "warning"], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        time.sleep(0.2)
    kill_group(proc)
    raise TimeoutError("the OpenEnv server did not come up")


def test_openenv_run_trains_and_counts_server_failures(tmp_path):
    env_port, run_dir = free_port(), tmp_path / "run"
    server = serve_openenv(env_port)
    args = (f"{{base_url: 'http://127.0.0.1:{env_port}', max_turns: 2, system_prompt: 'Reverse the text.', "
            f"max_sessions: 8, reset_args: {{fail_every: 2}}, action_failures: environment}}")
    try:
        proc = tidal("grpo", "--output-dir", str(run_dir), "--infer.port", str(free_port()), "--orch.max_steps", "2",
                     "--orch.batch_size", "16", "--orch.rollouts_per_example", "4", "--orch.sampling.max_tokens",
                     "256", "--orch.sampling.seed", "7", "--orch.env_outage.fraction", "1", "--orch.env",
                     f"[{{id: 'tidal.envs.openenv:OpenEnv', args: {args}}}]")
        try:
            out, _ = proc.communicate(timeout=900)
        finally:
            kill_group(proc)
    finally:
        kill_group(server)
    assert proc.returncode == 0, out[-4000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["mismatch_kl"] < 1e-3, "every turn was sampled from the exact token ids trained on"
    assert all(r["reward/openenv/mean"] is not None for r in rows)
    assert sum(r["reward/openenv/errors"] for r in rows) == 0, "a server failure is not a failed reward"
    dropped = sum(r["env/dropped_groups"] for r in rows)
    assert 0 < dropped < 8, "the failing episodes' groups (even seeds) were dropped and counted, the others scored"
    assert "an episode failed" in out and "EXECUTION_ERROR" in out, "the first failure is logged with its cause"
    batch = TrainingBatch.load(run_dir / "rollouts" / "step_1.safetensors")
    prompt_end = [int(np.argmax(batch.loss_mask[s] > 0)) for s in batch.samples()]
    # an episode that went on: turn 1 (loss mask 1), the server's observation (0), turn 2 (1 again)
    gaps = [np.count_nonzero(np.diff(batch.loss_mask[s][p:].astype(int)) == 1)
            for s, p in zip(batch.samples(), prompt_end, strict=True)]
    assert any(g >= 1 for g in gaps), gaps
