"""Data-parallel trainer ranks (train `gpus`, `zero_level`): torch.distributed + FSDP2, one node or several.

Launch. `tidal grpo-train` with `gpus: N > 1` and no rendezvous in its environment becomes torch's elastic
agent, in-process (`launch_ranks`): it starts N ranks of itself (`python -m tidal.cli grpo-train`, same
arguments) on a local rendezvous and watches them; when one dies it stops the others and exits 1 naming the
rank. Under `torchrun` (or any launcher that sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, e.g. across
nodes: docs/scale-out.md) the process is a rank directly. NCCL on GPUs (rank r of a node on `cuda:r`), gloo on
CPU-only machines, so CI runs the real thing with CPU ranks.

Roles. Every rank holds a shard of the policy (FSDP2 `fully_shard` on each decoder layer and on the root) and of
the optimizer state, and runs its share of each step's micro-batches (`tidal.trainer.step.schedule`). Rank 0 alone
talks to the outside: it reads each batch and broadcasts it to the others in the batch's own pickle-free wire
format (`broadcast_batch`), and it writes metrics, publishes policies, pushes weights and writes checkpoints and
exports. For that it keeps a plain, unsharded copy of the policy on CPU, the *view*, refreshed from the gathered
trainable parameters after every step (`gather_trainable`): the publishing code is the single-process code
applied to the view. Gradients are summed across ranks (FSDP's divide factor 1), because the loss is already
normalized over the whole optimizer step, all ranks' micro-batches included.

`zero_level` on FSDP2 (parameters and optimizer state are sharded at rest at every level):
- 1: parameters gathered once per micro-batch and kept through its backward (`reshard_after_forward=False`);
  gradients accumulate unsharded over the optimizer step's micro-batches and are reduce-scattered once, at its
  last micro-batch (`set_requires_gradient_sync`): the least communication, one full gradient per rank.
- 2: as 1, but gradients are reduce-scattered after every micro-batch (sharded gradients).
- 3: as 2, and each layer's parameters are freed after its forward and gathered again for its backward
  (`reshard_after_forward=True`): the least memory.
Checkpoints gather full (unsharded) tensors on rank 0 and store them in the single-process format
(`tidal.trainer.ckpt`), so a run resumes with any number of ranks.
"""

from __future__ import annotations

import logging
import os
import signal
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from tidal.procs import EXPORT_FAILED

log = logging.getLogger("tidal.trainer")

RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Ranks:
    """This process's place among the trainer ranks."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1

    @property
    def main(self) -> bool:
        """Rank 0: reads batches, publishes, checkpoints, logs."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world > 1


SINGLE = Ranks()


def under_rendezvous() -> bool:
    """True when a launcher (ours, torchrun, SLURM + torchrun, ...) made this process a rank."""
    return all(v in os.environ for v in RENDEZVOUS_VARS)


def env_ranks() -> Ranks:
    """The ranks the launcher's environment describes (SINGLE outside one)."""
    if not under_rendezvous():
        return SINGLE
    world = int(os.environ["WORLD_SIZE"])
    return Ranks(rank=int(os.environ["RANK"]), world=world, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                 local_world=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))


def _describe(failure: Any) -> str:
    if failure.exitcode < 0:
        try:
            return f"killed by {signal.Signals(-failure.exitcode).name}"
        except ValueError:
            return f"killed by signal {-failure.exitcode}"
    return f"exit code {failure.exitcode}"


def launch_ranks(nproc: int, argv: list[str], cpu_cores: list[int] | None = None) -> int:
    """Run `python -m tidal.cli *argv` as `nproc` ranks on a local rendezvous (torch's elastic agent, here in
    this process) and wait; returns 0, 1 after a rank failed (the others are stopped), or `EXPORT_FAILED` when rank
    0 trained to its end but could not write a final export."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    cores = len(cpu_cores) if cpu_cores else (os.cpu_count() or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    args = parse_args([f"--nproc-per-node={nproc}", "--max-restarts=0", "--monitor-interval=0.5",
                       "--module", "tidal.cli", *argv])
    # torchrun --standalone: a c10d store on a free local port, a fresh run id
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, cmd, cmd_args = config_from_args(args)
    log.info("starting %d trainer ranks (%s)", nproc, "NCCL" if torch.cuda.is_available() else "gloo, CPU")
    try:
        elastic_launch(config, cmd)(*cmd_args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if rank == 0 and failure.exitcode == EXPORT_FAILED:  # trained to the end; its error line says what is missing
            return EXPORT_FAILED
        log.error("trainer rank %d (pid %d) failed: %s; the other ranks were stopped", rank, failure.pid,
                  _describe(failure))
        return 1
    return 0


def rank_cores(cores: list[int] | None, ranks: Ranks) -> list[int] | None:
    """This rank's share of the trainer's `cpu_affinity` (each core to one rank; a rank gets at least one)."""
    if not cores or ranks.local_world == 1:
        return cores
    mine = cores[ranks.local_rank::ranks.local_world]
    return mine or [cores[ranks.local_rank % len(cores)]]


def init_ranks(gpus: int, device: str, timeout_s: float) -> tuple[Ranks, str]:
    """Join the process group the environment describes (NCCL on GPUs, gloo on CPU) and return the ranks and
    this rank's device string (train `device` for a single rank)."""
    ranks = env_ranks()
    if not ranks.sharded:
        return ranks, device
    if gpus != ranks.local_world:
        raise ValueError(f"train gpus is {gpus} but the launcher started {ranks.local_world} ranks on this node "
                         f"(LOCAL_WORLD_SIZE); set gpus to the ranks per node (torchrun --nproc-per-node)")
    import torch.distributed as dist

    if device.startswith("cuda:"):
        raise ValueError(f"train device {device!r} picks one GPU, but with gpus {gpus} rank r of a node runs on "
                         f"cuda:r; set device to auto or cuda (choose the GPUs with CUDA_VISIBLE_DEVICES)")
    cuda = device != "cpu" and torch.cuda.is_available()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"train device is {device!r} but no CUDA device is available")
    if cuda:
        if torch.cuda.device_count() < ranks.local_world:
            raise RuntimeError(f"train gpus is {ranks.local_world} but this node has {torch.cuda.device_count()} "
                               f"CUDA devices")
        torch.cuda.set_device(ranks.local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    if ranks.rank:
        logging.getLogger("tidal").setLevel(logging.WARNING)  # rank 0 reports; the others only warn
    return ranks, f"cuda:{ranks.local_rank}" if cuda else "cpu"


def comm_device(ranks: Ranks) -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", ranks.local_rank) if dist.get_backend() == "nccl" else torch.device("cpu")


def shard(model: torch.nn.Module, zero_level: int) -> None:
    """FSDP2 on each decoder layer (the model's `_no_split_modules` classes) and on the root (see module doc)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    get_base = getattr(model, "get_base_model", None)
    base: Any = get_base() if callable(get_base) else model
    blocks = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in blocks]
    if not layers:
        raise RuntimeError(f"{type(base).__name__} names no decoder-layer classes (_no_split_modules): cannot "
                           f"shard it layer by layer")
    for layer in layers:
        fully_shard(layer, reshard_after_forward=zero_level == 3)
    fully_shard(model, reshard_after_forward=False)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum: the loss is normalized over all ranks' micro-batches
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)


def set_gradient_sync(model: torch.nn.Module, zero_level: int, last_of_step: bool) -> None:
    """zero_level 1: reduce-scatter only at the last micro-batch of an optimizer step."""
    from torch.distributed.fsdp import FSDPModule

    if zero_level == 1 and isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last_of_step)


def reshard(model: torch.nn.Module) -> None:
    """Free the parameters no-grad forwards left gathered (`reshard_after_forward=False` keeps them): the next
    forward with grad gathers them again under autograd, so its backward reduce-scatters the gradients."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def broadcast_bytes(ranks: Ranks, data: bytes | None) -> bytes | None:
    """Rank 0's `data` (None: nothing more) on every rank."""
    import torch.distributed as dist

    dev = comm_device(ranks)
    size = torch.tensor([-1 if data is None else len(data)], dtype=torch.int64, device=dev)
    dist.broadcast(size, src=0)
    n = int(size.item())
    if n < 0:
        return None
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if ranks.main and data
           else torch.empty(n, dtype=torch.uint8, device=dev))
    if n:
        dist.broadcast(buf, src=0)
    return data if ranks.main else bytes(buf.cpu().numpy().tobytes())


def broadcast_batch(ranks: Ranks, batch: Any) -> Any:
    """Rank 0's TrainingBatch (or None: no more batches) on every rank, through its wire format."""
    from tidal.transport.batch import TrainingBatch

    if not ranks.sharded:
        return batch
    data = broadcast_bytes(ranks, None if batch is None else batch.to_bytes() if ranks.main else b"")
    if ranks.main:
        return batch
    return None if data is None else TrainingBatch.from_bytes(data)


def broadcast_int(ranks: Ranks, value: int) -> int:
    if not ranks.sharded:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=comm_device(ranks))
    dist.broadcast(t, src=0)
    return int(t.item())


def reduce_values(ranks: Ranks, values: dict[str, float], op: str = "sum") -> dict[str, float]:
    """Element-wise sum / min / max of `values` (the same keys on every rank) over the ranks."""
    if not ranks.sharded or not values:
        return dict(values)
    import torch.distributed as dist

    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=comm_device(ranks))
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op])
    return dict(zip(keys, t.cpu().tolist(), strict=True))


def grad_norm(norm: torch.Tensor) -> float:
    """clip_grad_norm_'s result as a float (a DTensor when the gradients are sharded)."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if callable(full) else norm)


def gather_trainable(ranks: Ranks, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The full trainable parameters on rank 0 (CPU), None elsewhere (collective: every rank all-gathers each
    parameter, in `named_parameters` order)."""
    full: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        gather = getattr(param, "full_tensor", None)
        value = gather() if callable(gather) else param
        if ranks.main:
            full[name] = value.detach().to("cpu", copy=True)
    return full if ranks.main else None


def refresh_view(view: torch.nn.Module, trainable: dict[str, torch.Tensor]) -> None:
    """Copy gathered trainable parameters into rank 0's unsharded view."""
    result = view.load_state_dict(trainable, strict=False)
    if result.unexpected_keys:
        raise RuntimeError(f"gathered parameters the view does not have: {result.unexpected_keys[:3]}")


def load_trainable(ranks: Ranks, model: torch.nn.Module, trainable: dict[str, torch.Tensor] | None) -> None:
    """Rank 0's full trainable parameters into every rank's shards (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state: dict[str, Any] = dict(trainable or {})
    set_model_state_dict(model, state, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=False))


def optimizer_state(ranks: Ranks, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The full optimizer state keyed by parameter name (rank-count independent), on rank 0 (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if ranks.main else None


def load_optimizer_state(ranks: Ranks, model: torch.nn.Module, opt: torch.optim.Optimizer,
                         state: dict[str, Any] | None) -> None:
    """Restore a name-keyed optimizer state (`optimizer_state`) held by rank 0 into every rank (collective)."""
    if ranks.sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, opt, state or {}, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        return
    assert state is not None
    names = {id(p): n for n, p in model.named_parameters()}
    index = {names[id(p)]: i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    missing = sorted(set(index) - set(state["param_groups"][0]["params"] if len(state["param_groups"]) == 1
                                      else [n for g in state["param_groups"] for n in g["params"]]))
    if missing:
        raise ValueError(f"the optimizer state has no entry for {missing[:3]}")
    opt.load_state_dict({"state": {index[n]: s for n, s in state["state"].items() if n in index},
                         "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                                          for g in state["param_groups"]]})


def rng_states(ranks: Ranks) -> list[torch.Tensor]:
    """Every rank's torch CPU RNG state (and its CUDA device's), on rank 0 (collective); [] elsewhere."""
    own = torch.get_rng_state()
    if torch.cuda.is_available() and ranks.sharded and comm_device(ranks).type == "cuda":
        own = torch.cat([own, torch.cuda.get_rng_state(ranks.local_rank)])
    if not ranks.sharded:
        return [own]
    import torch.distributed as dist

    dev = comm_device(ranks)
    parts = [torch.empty_like(own, device=dev) for _ in range(ranks.world)]
    dist.all_gather(parts, own.to(dev))
    return [p.cpu() for p in parts] if ranks.main else []


def set_rng_states(ranks: Ranks, states: list[torch.Tensor] | None) -> None:
    """Give each rank its saved RNG state when the checkpoint was written with as many ranks (collective)."""
    count = broadcast_int(ranks, len(states) if states else 0)
    if count != ranks.world:
        return  # another rank count: each rank keeps the state rank 0's checkpoint RNG gave it
    if not ranks.sharded:
        assert states is not None
        mine = states[0]
    else:
        import torch.distributed as dist

        dev = comm_device(ranks)
        size = broadcast_int(ranks, int(states[0].numel()) if ranks.main and states else 0)
        stacked = (torch.stack(states).to(dev) if ranks.main and states
                   else torch.empty(count, size, dtype=torch.uint8, device=dev))
        dist.broadcast(stacked, src=0)
        mine = stacked[ranks.rank].cpu()
    cpu_size = torch.get_rng_state().numel()
    torch.set_rng_state(mine[:cpu_size].clone())
    if mine.numel() > cpu_size and torch.cuda.is_available():
        torch.cuda.set_rng_state(mine[cpu_size:].clone(), ranks.local_rank)


def close(ranks: Ranks) -> None:
    """Leave the process group after a clean finish (a barrier first: no rank tears its connections down while
    another still talks to it). After a failure, just exit: the agent stops the other ranks."""
    if ranks.sharded:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

