"""`tidal eval`: score any model, adapter, checkpoint or GGUF on any environment with one vLLM server.

`evaluate(EvalConfig(...))` (`tidal.evaluate.run`) returns the rows' metrics (mean reward, greedy accuracy, pass@k
with the unbiased estimator, mean length, the share cut at the token limit, each with a 95% interval); `tidal eval`
(`tidal.evaluate.cli`) prints them as a table and writes a JSON report. docs/evaluation.md.
"""

from __future__ import annotations

from typing import Any


def evaluate(cfg: Any, progress: bool = True) -> Any:
    """`tidal.evaluate.run.evaluate` (imported on use: `import tidal` stays light)."""
    from tidal.evaluate.run import evaluate as run

    return run(cfg, progress)
