"""The start of a co-located run, written once: `tidal grpo` (`tidal.cli.cmd_grpo`) and the Python API
(`tidal.api.GRPOTrainer`) both call it.

- `derive(train, infer, orch, ...)`: `derive_colocate` on this machine, with what only the model and the installed
  vLLM can tell: the model's architecture (`tidal.models.arch`: mixture of experts, whether its base weights can be
  shared with vLLM, `tidal.colocate.sharing`) and the GPU memory split (`tidal.colocate.split.gpu_split`: the model's
  config.json, whether vLLM takes `--kv-cache-memory-bytes`, the trainer's estimate and, with `calibrate`, its peak
  measured on the GPU before vLLM starts, `tidal.trainer.calibrate.measure_in_child`); on a CPU-only machine, whether
  vLLM and the trainer fit its memory (`tidal.colocate.cpu_memory`);
- `start(co, ...)`: the checks that need the machine (SGLang runnable, vLLM has the nccl push, a secure bind, free
  ports), the notices, the run directory (resumed, or a previous run moved aside), the resolved configs in
  `{run_dir}/configs/` (`tidal.paths.configs_dir`), then the supervisor (`tidal.colocate.supervise.run_colocate`).

The refusals of the derived configs (`tidal.colocate.preflight.check_run`) run between the two, in the caller, so
that `--dry-run` and `GRPOTrainer(...)` run them without starting anything.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

import yaml

from tidal.colocate.cpu_memory import check_cpu_memory
from tidal.colocate.derive import Colocated, Machine, ModelFacts, derive_colocate
from tidal.colocate.pool import Attached
from tidal.colocate.start_order import StartupMode, start_plan
from tidal.colocate.teacher import serves_teacher
from tidal.config import ConfigError, InferConfig, OrchConfig, TrainConfig
from tidal.config.base import StrictModel
from tidal.models.arch import check_model
from tidal.models.limits import check_lengths
from tidal.paths import configs_dir, holds_run


def dump(cfg: StrictModel) -> str:
    """A config as the YAML a component reads back."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def derive(train: TrainConfig, infer: InferConfig, orch: OrchConfig, *, output_dir: str | Path | None = None,
           resume: bool = False, calibrate: bool = True, machine: Machine | None = None) -> Colocated:
    """`derive_colocate` on this machine for the model train.yaml names (module docs); `calibrate`: on a GPU the
    split measures the trainer's peak (one training step) instead of trusting the estimate alone. `machine`: the
    machine's facts (None: `Machine.detect()`; a test passes a GPU's memory this way)."""
    teacher = None
    if serves_teacher(orch):  # tidal grpo serves orch teacher.model itself: on a GPU its memory is reserved first
        assert orch.teacher is not None
        check_model(orch.teacher.model, "orch teacher")
        teacher = ModelFacts.read(orch.teacher.model)
    machine, model = machine or Machine.detect(), ModelFacts.read(train.model)
    co = derive_colocate(train, infer, orch, machine, output_dir=output_dir, resume=resume, model=model,
                         calibrate=calibrate, teacher=teacher)
    served = (co.teacher.infer, teacher.config) if co.teacher is not None and teacher and teacher.config else None
    if served is not None:
        check_lengths(served[0].model, served[1], {"orch seq_len": co.orch.seq_len}, None)
    if co.placement.device == "cpu":  # vLLM's copy and the trainer's share the machine's memory
        check_cpu_memory(co.train, co.infer, model.config, machine.memory_available_gib, served)
    return co


def check_startable(co: Colocated, pooled: bool = False) -> None:
    """The refusals that need this machine, before anything starts: SGLang without CUDA, a vLLM without the nccl
    push, an insecure bind, a taken port (each a `ConfigError`); `pooled`: the run uses the warm pool's server,
    whose ports are taken by it."""
    if co.infer.backend == "sglang":
        from tidal.inference.backends.sglang.server import check_runnable, has_cuda, sglang_installed

        check_runnable(has_cuda(), sglang_installed())
    from tidal.inference.backends.bind import InsecureBindError, check_bind_secure
    from tidal.inference.backends.vllm.support import check_weight_transfer
    from tidal.procs import PortInUseError, check_port_free

    if co.infer.backend == "vllm":
        check_weight_transfer(co.infer.weight_broadcast_type)  # a vLLM without the nccl push: exit 2 now
    place = co.placement
    try:
        check_bind_secure(co.infer)
        for port in range(place.port, place.port + co.infer.dp) if not pooled else ():  # infer dp servers
            check_port_free(place.host, port)
        if co.teacher is not None:
            check_port_free(place.host, co.teacher.infer.port)
    except (PortInUseError, InsecureBindError) as exc:
        raise ConfigError(str(exc)) from None


def prepare_run_dir(run_dir: Path) -> None:
    """A fresh run must not read a previous run's batches: move an old run aside (nothing is deleted)."""
    if holds_run(run_dir):
        aside = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(aside)
        print(f"[tidal] moved the previous run in {run_dir} to {aside}", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)


def write_configs(run_dir: Path, configs: Mapping[str, StrictModel]) -> dict[str, Path]:
    """Write each component's resolved config to `{run_dir}/configs/{name}.yaml`; returns the paths."""
    cfg_dir = configs_dir(run_dir)
    cfg_dir.mkdir(exist_ok=True)
    paths = {}
    for name, cfg in configs.items():
        paths[name] = cfg_dir / f"{name}.yaml"
        paths[name].write_text(dump(cfg))
    return paths


OrchFor = Callable[[OrchConfig, Path], OrchConfig]
"""The orch config the run uses, given the derived one and the run directory (the API's datasets)."""
InProcessOrch = Callable[[OrchConfig, Path], Coroutine[Any, Any, Any]]
"""An orchestrator run in this process on (orch, run_dir) instead of a `grpo-orch` child (the API)."""


def start(co: Colocated, *, live: bool = False, resume_hint: str | None = None, infer_restarts: int = 3,
          infer_start_timeout_s: float = 600.0, orch_for: OrchFor | None = None,
          orchestrator: InProcessOrch | None = None, extra_configs: Mapping[str, str] | None = None,
          startup: StartupMode = "auto") -> int:
    """Start the derived run and supervise it to the end (module docs); returns the exit code (0 done, 1 a component
    failed, 130 interrupted). `extra_configs`: more files for `{run_dir}/configs/` (name -> text); `startup`: which
    components start with vLLM (`tidal.colocate.start_order.start_plan`). With a warm pool running
    (`tidal serve`) the run attaches to its server instead of starting vLLM (`tidal.colocate.pool.attach`: a pool
    that does not match is a `ConfigError`, one that still serves another policy after its reset exits
    `procs.WRONG_POLICY`)."""
    from tidal.colocate.pool import PoolError, attach
    from tidal.procs import WRONG_POLICY
    from tidal.transport.probe import PolicyMismatch

    try:
        pool = attach(co)
    except (PolicyMismatch, PoolError) as exc:
        print(f"[tidal] error: {exc}", file=sys.stderr, flush=True)
        return WRONG_POLICY if isinstance(exc, PolicyMismatch) else 1
    try:
        return _start(co, pool, live=live, resume_hint=resume_hint, infer_restarts=infer_restarts,
                      infer_start_timeout_s=infer_start_timeout_s, orch_for=orch_for, orchestrator=orchestrator,
                      extra_configs=extra_configs, startup=startup)
    finally:
        if pool is not None:
            pool.release()


def _start(co: Colocated, pool: Attached | None, *, live: bool, resume_hint: str | None, infer_restarts: int,
           infer_start_timeout_s: float, orch_for: OrchFor | None, orchestrator: InProcessOrch | None,
           extra_configs: Mapping[str, str] | None, startup: StartupMode) -> int:
    """`start` once the pool (if any) is attached."""
    check_startable(co, pooled=pool is not None)
    place = co.placement
    for notice in (*place.notices, *(co.teacher.notices if co.teacher is not None else ())):
        print(f"[tidal] {notice}", flush=True)
    if place.resuming:
        place.run_dir.mkdir(parents=True, exist_ok=True)
        print(f"[tidal] resuming the run in {place.run_dir}", flush=True)
    else:
        prepare_run_dir(place.run_dir)
    orch = orch_for(co.orch, place.run_dir) if orch_for is not None else co.orch
    paths = write_configs(place.run_dir, {"train": co.train, "infer": co.infer, "orch": orch,
                                          **({"teacher": co.teacher.infer} if co.teacher is not None else {})})
    for name, text in (extra_configs or {}).items():
        (configs_dir(place.run_dir) / name).write_text(text)
    from tidal.colocate.supervise import PoolServer, run_colocate

    in_process = None
    if orchestrator is not None:
        async def in_process() -> None:
            await orchestrator(orch, place.run_dir)

    return run_colocate(sys.executable, place.run_dir, paths, place.health_urls, live=live,
                        infer_start_timeout_s=infer_start_timeout_s, max_steps=orch.max_steps,
                        resume_hint=resume_hint,
                        infer_restarts=0 if co.train.share_base_weights is True else infer_restarts,
                        infer_env=place.infer_env, orchestrator=in_process,  # shared base weights die with vLLM
                        teacher_health=co.teacher.health_url if co.teacher is not None else None,
                        teacher_env=co.teacher.env if co.teacher is not None else None,
                        teacher_restarts=infer_restarts,  # the teacher shares nothing with the trainer
                        plan=start_plan(place.device, startup),
                        pool=PoolServer(pool.state.infer_pid, pool.log_path) if pool is not None else None,
                        warm_trainer=kept_trainer(pool))


def kept_trainer(pool: Attached | None) -> Path | None:
    """The socket of the warm pool's kept trainer this run's trainer is forked from (`tidal.colocate.warm_trainer`),
    or None (no pool; a pool that keeps none: said in a line, with why)."""
    if pool is None:
        return None
    if pool.state.trainer is None:
        print(f"[tidal] the warm pool keeps no trainer ({pool.state.trainer_off}): this run's trainer loads the "
              f"model itself", flush=True)
        return None
    print(f"[tidal] this run's trainer is forked from the warm pool's kept trainer (pid {pool.state.trainer['pid']}: "
          f"torch imported, base model loaded)", flush=True)
    return Path(pool.state.trainer["socket"])
