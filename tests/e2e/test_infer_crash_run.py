"""A vLLM server that dies the same way after a restart is not restarted again, and the launcher names the cause.

The failure is real: a tiny Qwen3-MoE served by vLLM-CPU with LoRA enabled dies at its first request
(`AttributeError: module 'triton.language' has no attribute 'float32'`; its API server then exits 0). tidal
refuses infer `enable_lora: true` on such a model up front (`tidal.models.arch`), so the test passes vLLM's
`--enable-lora` through infer `extra_args`, which tidal hands to vLLM unread, and runs the launcher itself."""

from __future__ import annotations

import sys

import pytest

from tests.archs import build
from tests.conftest import free_port
from tidal.colocate.derive import Machine, ModelFacts, derive_colocate
from tidal.colocate.start import write_configs
from tidal.colocate.supervise import run_colocate
from tidal.config import InferConfig, OrchConfig, TrainConfig

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_server_that_dies_at_its_first_request_is_named_and_not_restarted_in_a_loop(tmp_path, capfd):
    model = str(build("qwen3-moe", tmp_path / "model"))
    run_dir = tmp_path / "run"
    orch = OrchConfig.model_validate({"max_steps": 2, "batch_size": 8, "rollouts_per_example": 4,
                                      "sampling": {"max_tokens": 8}})
    infer = InferConfig(model=model, port=free_port(), enable_lora=False, extra_args=["--enable-lora"])
    co = derive_colocate(TrainConfig(model=model), infer, orch, Machine.detect(), output_dir=run_dir,
                         model=ModelFacts(moe=True))
    run_dir.mkdir()
    paths = write_configs(run_dir, {"train": co.train, "infer": co.infer, "orch": co.orch})
    code = run_colocate(sys.executable, run_dir, paths, co.placement.health_urls, infer_env=co.placement.infer_env,
                        infer_start_timeout_s=600)
    err = capfd.readouterr().err
    assert code == 1, err[-3000:]
    cause = "AttributeError: module 'triton.language' has no attribute"  # 'float32' or 'bfloat16' (dtype)
    assert f"exited with code 0 (vLLM's API server exits 0 when its engine dies); first error: {cause}" in err, \
        err[-3000:]
    assert "restarting it (1 of 3)" in err
    # the restarted server dies the same way at the orchestrator's retry; the launcher then stops (or the
    # orchestrator has used up its step retries at that moment: whichever it notices first), never restarting
    # it a second time
    assert "(2 of 3)" not in err and ("died the same way after a restart" in err or "orchestrator" in err)
