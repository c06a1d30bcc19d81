"""transformers `TrainerCallback`s for `GRPOTrainer(callbacks=[...])`: the events of a tidal run, with TRL's names.

TRL calls its callbacks from the training loop in the script's process. tidal's trainer is another process, so
`RunCallbacks` follows the run from the script's process instead: `on_init_end` when the trainer is built,
`on_train_begin` before anything starts, then, on a watcher thread, for each row the run appends to
`{output_dir}/metrics.jsonl` (one per step, written once the trainer has trained it): `on_step_end`, then `on_log`
with the row under TRL 1.16's metric names (`trl_logs`), and `on_save` for each trainer checkpoint once complete;
after the run, the rows not yet seen and `on_train_end`. The callbacks get transformers' own `TrainerState`
(`global_step`, `max_steps`, `log_history`, ...) and `TrainerControl`, through transformers' `CallbackHandler`
(so a callback that returns a new control is honoured as in transformers). When a callback sets
`control.should_training_stop`, `stop` is set: the orchestrator writes no further batch (`tidal.orchestrator.loop.run`
`stop`), the trainer trains the batches already written and the run ends cleanly (exit 0). `model`, `optimizer`
and `lr_scheduler` are None in the callbacks' keyword arguments: they live in the trainer process.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

TRL_NAMES = {"reward/mean": "reward", "reward/std": "reward_std", "lr": "learning_rate",
             "progress/total_tokens": "num_tokens"}
"""tidal metric -> TRL 1.16's name for it (`completions/*`, `entropy`, `frac_reward_zero_std`, `clip_ratio/*`, `loss`,
`grad_norm` are already TRL's); per-function rewards `reward/{name}/mean|std` -> `rewards/{name}/mean|std`."""


def trl_logs(row: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl row as TRL logs it: its numbers, TRL's names where TRL has one, tidal's otherwise."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key == "step" or not isinstance(value, int | float) or isinstance(value, bool):
            continue
        name = TRL_NAMES.get(key, key)
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "reward" and parts[2] in ("mean", "std"):
            name = f"rewards/{parts[1]}/{parts[2]}"
        out[name] = float(value)
    return out


class RunCallbacks:
    """transformers callbacks fed with a tidal run's steps (see the module doc)."""

    def __init__(self, callbacks: list[Any], args: Any, processing_class: Any, max_steps: int) -> None:
        from transformers.trainer_callback import CallbackHandler, TrainerControl, TrainerState

        self.args = args
        self.handler = CallbackHandler(list(callbacks), None, processing_class, None, None)
        self.state = TrainerState(max_steps=max_steps, logging_steps=1, is_local_process_zero=True,
                                  is_world_process_zero=True)
        self.control = TrainerControl()
        self.stop = threading.Event()
        """Set once a callback asks the run to stop (`control.should_training_stop`)."""
        self.seen = 0
        self.announced: set[int] = set()
        """Checkpoint steps `on_save` was called for."""
        self.watcher: threading.Thread | None = None
        self.done = threading.Event()
        self.event("on_init_end")

    def event(self, name: str, **kwargs: Any) -> None:
        self.control = self.handler.call_event(name, self.args, self.state, self.control, **kwargs)
        if self.control.should_training_stop:
            self.stop.set()

    def begin(self, metrics: Path, saved: Callable[[], list[int]]) -> None:
        """`on_train_begin`, then follow `metrics` on a thread; `saved()`: the steps of the complete checkpoints."""
        self.event("on_train_begin")
        self.watcher = threading.Thread(target=self.follow, args=(metrics, saved), name="tidal-callbacks", daemon=True)
        self.watcher.start()

    def follow(self, metrics: Path, saved: Callable[[], list[int]]) -> None:
        while not self.done.wait(0.5):
            self.catch_up(metrics, saved)

    def catch_up(self, metrics: Path, saved: Callable[[], list[int]]) -> None:
        """The events of the rows of `metrics` not yet seen (complete lines only), then `on_save` for checkpoints
        of steps up to the last row's that are complete now and were not announced."""
        lines = metrics.read_text().split("\n")[:-1] if metrics.is_file() else []  # last: "" or a partial line
        for line in lines[self.seen:]:
            self.seen += 1
            self.step(json.loads(line))
            self.announce(saved)
        self.announce(saved)

    def step(self, row: dict[str, Any]) -> None:
        self.state.global_step = int(row["step"])
        self.event("on_step_end")
        logs = trl_logs(row)
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.event("on_log", logs=logs)

    def announce(self, saved: Callable[[], list[int]]) -> None:
        for n in saved():
            if n <= self.state.global_step and n not in self.announced:
                self.announced.add(n)
                self.event("on_save")

    def end(self, metrics: Path, saved: Callable[[], list[int]]) -> None:
        """Stop the watcher, deliver the rows it has not, then `on_train_end`."""
        self.done.set()
        if self.watcher is not None:
            self.watcher.join()
        self.catch_up(metrics, saved)
        self.event("on_train_end")
