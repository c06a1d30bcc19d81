"""The start-up order of `tidal grpo`: which component waits for the inference server, and the run's milestones.

vLLM takes 20-70 s to answer `/health` on a 2-core CPU (bench/STARTUP.md), almost all of it imports in one process
at a time; the trainer needs ~6 s (torch, transformers, peft imports, model load, LoRA) and the orchestrator ~1 s
(dataset, environments) before either can do anything. Before issue 37 both started only once vLLM was healthy, so
their start-up was added to vLLM's. Now (`start_plan`, mode `auto`):

- **CPU** (placement device `cpu`): the orchestrator and the trainer start with vLLM. Neither needs it to get
  ready: the orchestrator builds its environments and then waits in its client's `wait_ready` (probing every
  <= 0.5 s) until the server answers, the trainer builds its policy and waits for batch 1; nothing but the first
  request needs vLLM. (The orchestrator's `client.connect_timeout_s` then counts from vLLM's start.)
- **GPU** (placement device `cuda`): the trainer process starts with vLLM but waits for the *gate* (a file the
  launcher writes once every server is healthy, `paths.infer_ready_path`) right after its imports, before
  anything touches CUDA (`tidal grpo-train --start-gate`): vLLM sizes its KV cache from the memory it finds free
  while it profiles (and refuses to start when less than `gpu_memory_utilization` x total is free), and shared
  base weights (train `share_base_weights`) are vLLM's own tensors, so the trainer must not allocate before vLLM
  is up. So on a GPU only the imports overlap; the memory order is the one `tidal.colocate.split` planned for.
  The orchestrator starts after `/health` as before: it may hold a reward model on the GPU
  (`tidal.rewards.model`), and its `connect_timeout_s` (300 s) is shorter than a large model's first start.
- mode `sequential` (`tidal grpo --startup sequential`): the order before, both after `/health` (a baseline for
  `make bench` and bench/vllm_startup.py).

`Milestones` times the run's start from the children's log lines (orchestrator ready, trainer ready, first batch,
first step done) for the launcher's `[tidal] first step done after ...` line, which `make bench` reports.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

StartupMode = Literal["auto", "sequential"]
STARTUP_MODES: tuple[str, ...] = ("auto", "sequential")
GATE_POLL_S = 0.1
"""How often a gated trainer looks for the gate file (a stat; a long interval only delays the trainer)."""

log = logging.getLogger("tidal.colocate.start_order")


@dataclass(frozen=True)
class StartPlan:
    """When the co-located orchestrator and trainer start, relative to the inference server."""

    orch_early: bool
    """Start the orchestrator with vLLM (else once every server answers `/health`)."""
    train_early: bool
    """Start the trainer with vLLM (else once every server answers `/health`)."""
    train_gated: bool
    """An early trainer waits for the gate file after its imports, before it touches the GPU."""

    def describe(self) -> str:
        """Which components start with vLLM, for the launcher's lines."""
        early = [name for name, on in (("orchestrator", self.orch_early), ("trainer", self.train_early)) if on]
        gate = " (the trainer builds its model once vLLM is up: GPU memory order)" if self.train_gated else ""
        return f"{' and '.join(early)} started with it{gate}" if early else "starting orchestrator and trainer"


SEQUENTIAL = StartPlan(orch_early=False, train_early=False, train_gated=False)


def start_plan(device: str, mode: StartupMode = "auto") -> StartPlan:
    """The start order for a co-located run on `device` (placement `cpu` | `cuda`); the module docstring says
    why. `mode` `sequential`: everything after `/health`."""
    if mode == "sequential":
        return SEQUENTIAL
    if device == "cpu":
        return StartPlan(orch_early=True, train_early=True, train_gated=False)
    return StartPlan(orch_early=False, train_early=True, train_gated=True)


def wait_for_gate(gate: Path, timeout_s: float) -> float:
    """Block until `gate` exists (the launcher writes it once inference is healthy); returns the seconds waited.
    `TimeoutError` after `timeout_s` (the launcher stops the trainer long before, when vLLM fails to start)."""
    start = next_log = time.monotonic()
    while not gate.exists():
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise TimeoutError(f"the inference server was not ready after {waited:.0f} s ({gate} never appeared)")
        if time.monotonic() >= next_log:
            log.info("imports done; waiting for the inference server before building the model (%s)", gate)
            next_log += 30.0
        time.sleep(GATE_POLL_S)
    return time.monotonic() - start


MILESTONES: tuple[tuple[str, str, str], ...] = (
    ("orchestrator ready", "orch", r"orchestrator ready: "),
    ("trainer ready", "train", r"trainer ready on "),
    ("first batch", "orch", r"batch \d+ written"),
    ("first step done", "train", r"\] step \d+"),
)
"""(name, component, pattern of its first log line that marks it): lines tidal's orchestrator
(`orchestrator.loop`) and trainer (`trainer.grpo`, `monitor.metrics.progress_line`) print."""


class Milestones:
    """Seconds from `start` to each of `MILESTONES` (`feed` from each child's log-copying thread), and vLLM's
    `ready` (set by the launcher)."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.marks: dict[str, float] = {}
        self._patterns = [(name, who, re.compile(pattern)) for name, who, pattern in MILESTONES]

    def feed(self, component: str, line: str) -> None:
        now = time.monotonic() - self.start
        for name, who, pattern in self._patterns:
            if who == component and name not in self.marks and pattern.search(line):
                self.marks[name] = now

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, time.monotonic() - self.start)

    def done(self) -> bool:
        return "first step done" in self.marks

    def summary(self) -> str:
        """`first step done after 23.4 s (vLLM ready 20.1, orchestrator ready 2.3, ...)`: every mark seen, in
        the order they happened, as seconds since vLLM was started."""
        first = self.marks.get("first step done")
        rest = ", ".join(f"{name} {s:.1f}" for name, s in sorted(self.marks.items(), key=lambda kv: kv[1])
                         if name != "first step done")
        head = f"first step done after {first:.1f} s" if first is not None else "start-up"
        return f"{head} ({rest} s since vLLM was started)"
