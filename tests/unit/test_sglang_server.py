"""infer `backend: sglang`: every infer key maps onto a `python -m sglang.launch_server` argument or exits 2, and a
machine without CUDA (this one) refuses SGLang before anything starts. The argument names are SGLang 0.5.16's
(`sglang/srt/server_args.py` of its wheel); no SGLang runs here (docs/sglang.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tidal.assets import ASSETS
from tidal.config.infer import SGLANG_UNMAPPED, InferConfig
from tidal.config.load import ConfigError
from tidal.inference.backends.sglang.server import check_runnable, has_cuda, sglang_argv, sglang_env


def argv_of(cfg: InferConfig) -> list[str]:
    """The command line without its launch stamp (`--weight-version tidal-launch-<ns>`, new at every call)."""
    argv = sglang_argv(cfg)
    i = argv.index("--weight-version")
    assert argv[i + 1].startswith("tidal-launch-")
    return argv[:i] + argv[i + 2:]


def value_after(argv: list[str], flag: str) -> str:
    assert flag in argv, f"{flag} missing from {argv}"
    return argv[argv.index(flag) + 1]


TEMPLATE = ASSETS / "tiny-reverse" / "chat_template.jinja"
MAPPED = {  # infer key: (value away from its default, what the argv must then hold)
    "port": (8123, lambda a: value_after(a, "--port") == "8123"),
    "host": ("127.0.0.2", lambda a: value_after(a, "--host") == "127.0.0.2"),
    "dtype": ("float16", lambda a: value_after(a, "--dtype") == "float16"),
    "max_model_len": (4096, lambda a: value_after(a, "--context-length") == "4096"),
    "kv_cache_dtype": ("fp8", lambda a: value_after(a, "--kv-cache-dtype") == "fp8_e4m3"),
    "gpu_memory_utilization": (0.4, lambda a: value_after(a, "--mem-fraction-static") == "0.4"),
    "tp": (2, lambda a: value_after(a, "--tp-size") == "2"),
    "seed": (7, lambda a: value_after(a, "--random-seed") == "7"),
    "enforce_eager": (True, lambda a: "--disable-decode-cuda-graph" in a and "--disable-prefill-cuda-graph" in a),
    "trust_remote_code": (True, lambda a: "--trust-remote-code" in a),
    "enable_lora": (False, lambda a: "--enable-lora" not in a and "--max-lora-rank" not in a),
    "max_lora_rank": (64, lambda a: value_after(a, "--max-lora-rank") == "64"),
    "lora_target_modules": (["q_proj", "o_proj"], lambda a: a[a.index("--lora-target-modules") + 1:][:3]
                            == ["q_proj", "o_proj", "--max-loras-per-batch"]),
    "max_loras": (3, lambda a: value_after(a, "--max-loras-per-batch") == "3"),
    "max_cpu_loras": (20, lambda a: value_after(a, "--max-loaded-loras") == "20"),
    "enable_prefix_caching": (False, lambda a: "--disable-radix-cache" in a),
    "block_size": (32, lambda a: value_after(a, "--page-size") == "32"),
    "chat_template": (str(TEMPLATE), lambda a: value_after(a, "--chat-template") == str(TEMPLATE.resolve())),
    "log_stats": (False, lambda a: "--enable-metrics" not in a),
    "extra_args": (["--attention-backend", "triton"], lambda a: a[-2:] == ["--attention-backend", "triton"]),
}
NO_ARGUMENT = {  # keys that need no SGLang argument (the launch is the same; their effect is elsewhere)
    "backend": "selects this launcher",
    "model": "always --model-path and --served-model-name (test_model_is_served_under_its_configured_name)",
    "dp": "tidal's dp: N servers on consecutive ports (tidal.inference.backends.dp, shared)",
    "weight_broadcast_type": "SGLang always serves its distributed update routes",
    "weight_reload": "SGLang always serves /update_weights_from_disk",
}


def test_every_infer_key_is_mapped_refused_or_needs_no_argument():
    keys = set(InferConfig.model_fields)
    covered = set(MAPPED) | set(NO_ARGUMENT) | set(SGLANG_UNMAPPED) | set(InferConfig.REFUSED)
    assert keys == covered, f"unaccounted infer keys: {keys - covered}; stale: {covered - keys}"


@pytest.mark.parametrize("key", sorted(MAPPED))
def test_a_mapped_key_changes_the_sglang_command_line(key):
    value, check = MAPPED[key]
    base = argv_of(InferConfig(model="tidal:tiny-reverse", backend="sglang"))
    argv = argv_of(InferConfig(model="tidal:tiny-reverse", backend="sglang", **{key: value}))
    assert argv != base, f"{key}={value!r} did not change the command line"
    assert check(argv), f"{key}={value!r}: {argv}"


def test_model_is_served_under_its_configured_name_and_lora_targets_the_trainers_modules():
    argv = sglang_argv(InferConfig(model="tidal:tiny-reverse", backend="sglang"))
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert value_after(argv, "--served-model-name") == "tidal:tiny-reverse"
    assert value_after(argv, "--model-path").endswith("tiny-reverse")
    assert value_after(argv, "--max-lora-rank") == "16"
    targets = argv[argv.index("--lora-target-modules") + 1:argv.index("--max-loras-per-batch")]
    assert targets == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]  # not `all`
    stamps = {value_after(sglang_argv(InferConfig(model="tidal:tiny-reverse", backend="sglang")), "--weight-version")
              for _ in range(2)}
    assert len(stamps) == 2, "every start gets its own launch stamp (how the client notices a restart)"


def test_the_api_key_comes_from_the_environment_and_logprobs_are_after_temperature(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "s3cret")
    cfg = InferConfig(model="tidal:tiny-reverse", backend="sglang")
    assert value_after(sglang_argv(cfg), "--api-key") == "s3cret"
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    assert sglang_env(cfg)["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "false"


@pytest.mark.parametrize("key", sorted(SGLANG_UNMAPPED))
def test_a_key_sglang_cannot_map_exits_2_naming_it(key):
    away = {"cpu_kvcache_space_gib": 4.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "export_base_weights": True, "return_routed_experts": True, "engine_core_start": "spawn",
            "aot_compile": True, "malloc": "tcmalloc"}[key]
    with pytest.raises(ValueError, match=f"backend sglang: {key}"):
        InferConfig(model="m", backend="sglang", **{key: away})
    InferConfig(model="m", backend="vllm", **{key: away})  # vLLM takes it


def test_sglang_needs_cuda_and_the_package():
    with pytest.raises(ConfigError, match="needs a CUDA GPU.*docs/sglang.md"):
        check_runnable(cuda=False, installed=True)
    with pytest.raises(ConfigError, match="not installed.*sglang_gpu_bundle.sh"):
        check_runnable(cuda=True, installed=False)
    check_runnable(cuda=True, installed=True)


@pytest.mark.skipif(has_cuda(), reason="a CUDA machine would start SGLang (tests/e2e/test_sglang_gpu.py)")
def test_grpo_infer_with_sglang_on_this_cpu_machine_exits_2_before_starting_anything():
    r = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo-infer", "--infer.backend", "sglang"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "needs a CUDA GPU" in r.stderr and "starting SGLang" not in r.stdout


def test_grpo_tells_the_orchestrator_and_the_trainer_which_backend_serves():
    import yaml

    r = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo", "--dry-run", "--infer.backend", "sglang",
                        "--orch.weight_broadcast.type", "nccl"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    train, infer, orch = [yaml.safe_load(part.split("---\n", 1)[1]) for part in r.stdout.split("# --- ")[1:]]
    assert infer["backend"] == orch["client"]["backend"] == train["weight_broadcast"]["backend"] == "sglang"


def test_dtype_auto_is_the_trainers_bfloat16_not_sglangs_own_auto():
    # SGLang's own `auto` serves a float32 checkpoint in float16; tidal's GPU trainer trains in bfloat16
    argv = sglang_argv(InferConfig(model="tidal:tiny-reverse", backend="sglang"))
    assert value_after(argv, "--dtype") == "bfloat16"
    assert value_after(sglang_argv(InferConfig(model="tidal:tiny-reverse", backend="sglang", dtype="float32")),
                       "--dtype") == "float32"
