"""The live console board of `tidal grpo` on a terminal: progress, key metrics, time left, waiting states.

The supervisor feeds it every line its children print (`note_line`) and the trainer's records from
`metrics.jsonl` (`note_metrics`); `render()` returns a rich renderable that `rich.live.Live` redraws below the
scrolling log lines. When stdout is not a terminal (CI logs, pipes) none of this runs and the components'
plain progress lines are all there is.
"""

from __future__ import annotations

import re
import time
from typing import Any

from rich.console import Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

WAITING = re.compile(r"(waiting for .*)$")


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Board:
    """What the live display shows; updated from log lines and metrics records."""

    def __init__(self, max_steps: int | None) -> None:
        self.max_steps = max_steps
        self.last: dict[str, Any] = {}
        self.step_times: list[float] = []
        self.state = {"infer": "starting", "orch": "starting", "train": "starting"}
        self.started = time.monotonic()

    def note_line(self, component: str, line: str) -> None:
        text = line.strip()
        if not text:
            return
        m = WAITING.search(text)
        if "finished" in text or "run report" in text:
            self.state[component] = "finished"
        elif m:
            self.state[component] = m.group(1)
        elif "batch" in text and "written" in text:
            written = text.split("batch", 1)[1].split("written", 1)[0].strip()
            self.state[component] = f"batch {written} written; sampling the next one"
        elif "| reward" in text:
            self.state[component] = "training"

    def note_metrics(self, row: dict[str, Any]) -> None:
        self.last = row
        if isinstance(row.get("step_time_s"), int | float):
            self.step_times.append(float(row["step_time_s"]))
        self.max_steps = self.max_steps or row.get("max_steps")

    def eta(self) -> float | None:
        if not self.max_steps or not self.step_times:
            return None
        recent = self.step_times[-5:]
        return max(0, self.max_steps - int(self.last.get("step", 0))) * sum(recent) / len(recent)

    def render(self) -> Group:
        m = self.last
        step = int(m.get("step", 0))
        total = self.max_steps or 0
        bar = ProgressBar(total=max(total, 1), completed=step, width=40)
        head = Text.assemble(("tidal grpo  ", "bold"), f"step {step}/{total or '?'}  ",
                             f"elapsed {format_eta(time.monotonic() - self.started)}  ",
                             (f"time left {format_eta(self.eta())}", "cyan"))
        stats = Table.grid(padding=(0, 2))
        for _ in range(6):
            stats.add_column()

        def num(key: str, fmt: str) -> str:
            v = m.get(key)
            return format(v, fmt) if isinstance(v, int | float) else "-"

        stats.add_row(f"reward {num('reward/mean', '.3f')} ± {num('reward/std', '.3f')}",
                      f"kl {num('kl', '.2e')}", f"mismatch_kl {num('mismatch_kl', '.1e')}",
                      f"masked {100 * m.get('masked', 0):.1f}%",
                      f"rollout {num('rollout_tokens_per_s', '.0f')} tok/s",
                      f"trainer {num('trainer_tokens_per_s', '.0f')} tok/s")
        states = Table.grid(padding=(0, 1))
        states.add_column(style="bold")
        states.add_column()
        for name in ("infer", "orch", "train"):
            states.add_row(name, self.state[name])
        return Group(head, bar, stats, states)
