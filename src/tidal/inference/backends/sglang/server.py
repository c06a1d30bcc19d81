"""`tidal grpo-infer` with infer `backend: sglang`: start `python -m sglang.launch_server` for an InferConfig.

The infer keys map onto SGLang 0.5.16's arguments (`sglang/srt/server_args.py`; names read from its wheel):

| infer key | SGLang |
|---|---|
| model | `--model-path` (the resolved directory) and `--served-model-name` (the name as configured) |
| host, port | `--host`, `--port` |
| dtype | `--dtype` (same choices; `auto` is the trainer's bfloat16, not SGLang's own `auto`) |
| kv_cache_dtype | `--kv-cache-dtype` (`fp8` as `fp8_e4m3`, vLLM's meaning on NVIDIA GPUs) |
| max_model_len | `--context-length` |
| gpu_memory_utilization | `--mem-fraction-static` (SGLang's static pool: weights + KV cache) |
| tp | `--tp-size` |
| dp | N SGLang servers on ports `port`.. (tidal's dp, as for vLLM: `tidal.inference.backends.dp`) |
| enable_lora, max_lora_rank | `--enable-lora --max-lora-rank R` (R: 16 when unset) |
| lora_target_modules | `--lora-target-modules` with the trainer's resolved names (`tidal.models.lora`; |
| | never `all`, which adds the embeddings and LM head); a name SGLang cannot adapt exits 2 |
| max_loras, max_cpu_loras | `--max-loras-per-batch`, `--max-loaded-loras` |
| enable_prefix_caching false | `--disable-radix-cache` |
| block_size | `--page-size` (tokens per KV page, the radix cache's sharing unit) |
| enforce_eager | `--disable-decode-cuda-graph --disable-prefill-cuda-graph` (`--disable-cuda-graph` is deprecated) |
| trust_remote_code | `--trust-remote-code` |
| chat_template | `--chat-template` (a file's absolute path; SGLang reads files only, so an inline template exits 2) |
| seed | `--random-seed` |
| log_stats | `--enable-metrics` unless false |
| VLLM_API_KEY (environment) | `--api-key` (the same variable as for vLLM, which clients read: `client.api_key_var`) |
| weight_broadcast_type, weight_reload | no argument: SGLang always serves `/update_weights_from_disk` and the |
| | distributed update routes |
| extra_args | appended verbatim |
| (always) | `--weight-version tidal-launch-<ns>`: the start stamp the client notices restarts by (`LAUNCH_VERSION`) |

The keys in `tidal.config.infer.SGLANG_UNMAPPED` have no equivalent and exit 2 when set. The server always runs
with `SGLANG_RETURN_ORIGINAL_LOGPROB=false`: its sampled-token logprobs are then those of the temperature-scaled
distribution it sampled from, as vLLM's `processed_logprobs` are (docs/sglang.md). SGLang runs on CUDA GPUs only
here: on a machine without one, or without sglang installed, start-up exits 2 before anything starts
(`check_runnable`; evidence in docs/sglang.md, the wheels in scripts/sglang_gpu_bundle.sh).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

from tidal.config.chat_template import template_arg
from tidal.config.infer import InferConfig
from tidal.config.load import ConfigError
from tidal.inference.backends.bind import check_bind_secure
from tidal.inference.backends.sglang.client import LAUNCH_VERSION
from tidal.models.sources import resolve_model
from tidal.procs import bind_host, check_port_free

API_KEY_VAR = "VLLM_API_KEY"
LORA_RANK_DEFAULT = 16


def sglang_argv(cfg: InferConfig) -> list[str]:
    """Command line that starts one SGLang server for `cfg` (the API key is added by `sglang_env`'s caller). Infer
    `dtype: auto` is the trainer's (bfloat16: SGLang runs on GPUs only), never SGLang's own `auto`, which serves a
    float32 model in float16."""
    from tidal.inference.precision import trainer_dtype

    dtype = trainer_dtype("auto", "cuda") if cfg.dtype == "auto" else cfg.dtype
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", resolve_model(cfg.model),
            "--served-model-name", cfg.model, "--host", bind_host(cfg.host), "--port", str(cfg.port),
            "--dtype", dtype, "--tp-size", str(cfg.tp), "--random-seed", str(cfg.seed),
            "--mem-fraction-static", str(cfg.gpu_memory_utilization),
            "--weight-version", f"{LAUNCH_VERSION}{time.time_ns()}"]
    if cfg.max_model_len:
        argv += ["--context-length", str(cfg.max_model_len)]
    if cfg.kv_cache_dtype != "auto":  # SGLang names the formats; vLLM's `fp8` is e4m3 on NVIDIA GPUs
        argv += ["--kv-cache-dtype", "fp8_e4m3" if cfg.kv_cache_dtype == "fp8" else cfg.kv_cache_dtype]
    if cfg.enforce_eager:
        argv += ["--disable-decode-cuda-graph", "--disable-prefill-cuda-graph"]
    if cfg.trust_remote_code:
        argv.append("--trust-remote-code")
    if cfg.chat_template is not None:  # a file (InferConfig refuses an inline template with SGLang)
        argv += ["--chat-template", template_arg(cfg.chat_template)]
    if cfg.enable_lora:
        argv += ["--enable-lora", "--max-lora-rank", str(cfg.max_lora_rank or LORA_RANK_DEFAULT),
                 "--lora-target-modules", *sglang_lora_targets(cfg), "--max-loras-per-batch", str(cfg.max_loras),
                 "--max-loaded-loras", str(cfg.max_cpu_loras or cfg.max_loras)]
    if cfg.enable_prefix_caching is False:
        argv.append("--disable-radix-cache")
    if cfg.block_size is not None:
        argv += ["--page-size", str(cfg.block_size)]
    if cfg.log_stats is not False:
        argv.append("--enable-metrics")
    key = os.environ.get(API_KEY_VAR)
    if key and "--api-key" not in cfg.extra_args:
        argv += ["--api-key", key]
    return argv + list(cfg.extra_args)


SGLANG_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                       "gate_up_proj")
"""The LoRA targets SGLang 0.5.16 serves (`sglang.srt.utils.SUPPORTED_LORA_TARGET_MODULES`, less the embeddings
and LM head that tidal never trains)."""


def sglang_lora_targets(cfg: InferConfig) -> list[str]:
    """infer `lora_target_modules` resolved on the model, for `--lora-target-modules`. Raises `ConfigError` (exit 2)
    for a target SGLang cannot serve."""
    from tidal.models.lora import served_targets

    targets = served_targets(resolve_model(cfg.model), cfg.lora_target_modules, cfg.trust_remote_code)
    unsupported = [t for t in targets if t not in SGLANG_LORA_MODULES]
    if unsupported:
        raise ConfigError(f"infer backend sglang: LoRA on {', '.join(unsupported)} (train/infer lora_target_modules) "
                          f"is not served by SGLang 0.5.16, which adapts only {', '.join(SGLANG_LORA_MODULES)}; "
                          "name those in lora_target_modules, or use backend: vllm")
    return targets


def sglang_env(cfg: InferConfig) -> dict[str, str]:
    """The server's environment: logprobs after temperature, no Hub access unless asked for."""
    env = dict(os.environ)
    env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "false"  # the behaviour logprobs must be the sampling distribution's
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    return env


def has_cuda() -> bool:
    """Whether torch sees a CUDA device here."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def check_runnable(cuda: bool, installed: bool) -> None:
    """Raise ConfigError (exit 2) when SGLang cannot serve on this machine: no CUDA GPU (no CPU wheel of its kernels
    exists, docs/sglang.md) or sglang not installed (scripts/sglang_gpu_bundle.sh packs it for the GPU machines)."""
    if not cuda:
        raise ConfigError("infer backend: sglang needs a CUDA GPU: SGLang's kernels (sglang-kernel) ship CUDA builds "
                          "only and its CPU path needs a source build for AMX Xeons, which this machine is not "
                          "(evidence in docs/sglang.md); use backend: vllm here")
    if not installed:
        raise ConfigError("infer backend: sglang, but the `sglang` package is not installed in this environment; "
                          "install sglang 0.5.16 (the release for torch 2.11; scripts/sglang_gpu_bundle.sh packs it "
                          "with sglang-kernel for GPU machines without a registry)")


def sglang_installed() -> bool:
    return importlib.util.find_spec("sglang") is not None


def serve(cfg: InferConfig) -> int:
    """With dp 1, become the SGLang server (does not return); with dp N, start and supervise N servers on ports
    `port`..`port + N - 1`, each on its own `tp` GPU(s). Raises ConfigError / PortInUseError / InsecureBindError /
    PlacementError before anything starts."""
    check_runnable(has_cuda(), sglang_installed())
    host = bind_host(cfg.host)
    check_bind_secure(cfg)
    resolve_model(cfg.model)
    if cfg.dp == 1:
        check_port_free(host, cfg.port)
        argv = sglang_argv(cfg)
        from tidal.procs.reaper import start_reaper

        start_reaper()  # SGLang's scheduler and detokenizer processes die with it
        print(f"tidal grpo-infer: starting SGLang on {host}:{cfg.port}", flush=True)
        os.execve(argv[0], argv, sglang_env(cfg))
    from tidal.inference.backends import dp

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    plans = dp.plan_servers(cfg, dp.visible_gpus(os.environ, cpu=False), cores, os.environ)
    for plan in plans:
        check_port_free(host, plan.port)
    return dp.run_servers(cfg, plans, host, sglang_argv, sglang_env(cfg), engine="SGLang")
