"""Where a run's files live, and how a trainer finds the run directory its orchestrator writes to.

Layout of a run directory: `rollouts/step_{n}.safetensors` (+ `DONE`), `broadcasts/step_{n}/` (+ `STABLE`),
`metrics.jsonl`, `logs/`. The seed's trainer `output_dir` may be the run directory itself or a parent that
holds `run_*` run directories; `--output-dir DIR` on the command line makes DIR the run directory of every
component.
"""

from __future__ import annotations

import time
from pathlib import Path


def find_run_dir(output_dir: str | Path, timeout_s: float = 600.0, poll_s: float = 0.5) -> Path:
    """Resolve the trainer's run directory, waiting up to `timeout_s` for the orchestrator to create it."""
    root = Path(output_dir)
    if root.name.startswith("run_") or (root / "rollouts").is_dir():
        return root
    start = time.monotonic()
    while True:
        runs = sorted(d for d in root.glob("run_*") if (d / "rollouts").is_dir()) if root.is_dir() else []
        if len(runs) == 1:
            return runs[0]
        if len(runs) > 1:
            raise RuntimeError(f"{root} holds several run directories ({', '.join(r.name for r in runs)}); "
                               "set output_dir to one of them or pass --output-dir")
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"no run directory with rollouts/ appeared under {root} in {timeout_s:.0f} s; "
                               "is the orchestrator running with the same output_dir?")
        time.sleep(poll_s)
