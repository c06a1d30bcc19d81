"""Which micro-batches each rank runs, in which optimizer step, for one rollout batch (pure functions).

A rollout batch packs into M micro-batches (`tidal.trainer.step.packing`). They are cut, in order, into optimizer
steps: `gradient_accumulation_steps` G micro-batches per rank per step (seed 000: "micro-batches per optimizer
step"), i.e. G x ranks per step, or, with TRL's `steps_per_generation` S, into S near-equal shares. Each
optimizer step's loss is normalized over its own micro-batches (`LossScale` of the step's share).

Within a step, micro-batches go to ranks by work (padded tokens, largest first, to the least loaded rank), and
each rank runs its share in batch order. FSDP needs every rank to run the same number of forward/backward
passes (each one gathers parameters collectively), so a rank with fewer micro-batches pads its list with a copy
of the step's smallest micro-batch, run with loss weight 0 (`real` False): it adds nothing to the gradients or
the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerStep:
    """One optimizer step of a rollout batch."""

    micro: list[int]
    """Indices of the micro-batches whose loss it trains (all ranks together), in batch order."""
    slots: list[list[int]]
    """Per rank, the micro-batch indices it runs, in order; every rank has the same number of slots."""
    real: list[list[bool]]
    """Per rank and slot: False for a padding slot (loss weight 0, no metrics)."""


def optimizer_groups(num_micro: int, world: int, accumulation: int,
                     steps_per_generation: int | None = None) -> list[list[int]]:
    """Micro-batch indices of each optimizer step, in batch order."""
    if num_micro <= 0:
        return []
    if steps_per_generation is not None:
        k = min(steps_per_generation, num_micro)
        bounds = [round(i * num_micro / k) for i in range(k + 1)]
        return [list(range(bounds[i], bounds[i + 1])) for i in range(k)]
    size = max(1, accumulation * world)
    return [list(range(s, min(s + size, num_micro))) for s in range(0, num_micro, size)]


def assign(group: list[int], work: list[int], world: int) -> OptimizerStep:
    """Spread `group`'s micro-batches over `world` ranks balanced by `work` (per micro-batch, indexed like the
    batch), padded to equal slot counts (see module doc)."""
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(group, key=lambda j: (-work[j], j)):
        r = min(range(world), key=lambda q: (load[q], len(shares[q]), q))
        shares[r].append(i)
        load[r] += work[i]
    width = max(len(s) for s in shares)
    pad = min(group, key=lambda j: (work[j], j))
    return OptimizerStep(micro=sorted(group),
                         slots=[sorted(s) + [pad] * (width - len(s)) for s in shares],
                         real=[[True] * len(s) + [False] * (width - len(s)) for s in shares])


def plan(work: list[int], world: int, accumulation: int,
         steps_per_generation: int | None = None) -> list[OptimizerStep]:
    """The optimizer steps of a batch whose micro-batches have `work` (padded tokens) each."""
    return [assign(g, work, world)
            for g in optimizer_groups(len(work), world, accumulation, steps_per_generation)]
