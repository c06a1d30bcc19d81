"""`{run_dir}/metrics.jsonl`: one JSON object per completed step, appended and flushed line by line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tidal.paths import write_atomic


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsWriter:
    """Append-only JSONL writer; each record is one line written with a single write call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({k: _clean(v) for k, v in record.items()}, sort_keys=False) + "\n"
        with open(self.path, "a") as f:
            f.write(line)
            f.flush()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(path: Path, last_step: int) -> int:
    """Keep only records with `step <= last_step` (and drop a torn last line), rewriting the file atomically
    (`tidal.paths.write_atomic`); returns how many records were dropped. Used when a component resumes."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line torn by a kill mid-write
            dropped += 1
            continue
        if isinstance(record, dict) and int(record.get("step", 0)) <= last_step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        write_atomic(path, "".join(f"{line}\n" for line in kept))
    return dropped


def progress_line(m: dict[str, Any], max_steps: int | None, eta_s: float | None = None) -> str:
    """One readable console line for a step's metrics (`eta_s`: estimated time left)."""
    total = f"/{max_steps}" if max_steps else ""
    return (f"step {m['step']}{total} | reward {m.get('reward/mean', float('nan')):.3f} "
            f"± {m.get('reward/std', float('nan')):.3f} | mismatch_kl {m.get('mismatch_kl', 0):.1e} "
            f"| masked {100 * m.get('masked', 0):.1f}% | loss {m.get('loss', 0):+.4f} "
            + (f"| kl {m['kl']:.2e} " if m.get("kl") is not None else "")
            + f"| grad {m.get('grad_norm', 0):.3f} | {m.get('step_time_s', 0):.1f} s "
            f"(rollout {m.get('rollout_time_s', 0):.1f} s, train {m.get('train_time_s', 0):.1f} s) "
            f"| off-policy {m.get('off_policy_level', 0)}"
            + (f" | time left {eta_s:.0f} s" if eta_s is not None else ""))
