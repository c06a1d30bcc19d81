"""Start-up cuts measured for issue 68 (bench/GOALS-68.md, "Start-up cuts measured"): bench/vllm_startup.py with
three more variants of `tidal grpo`'s CPU server (LoRA off), for `tidal grpo-infer` starts:

- `nolora-fork`: the engine core forked from the API server instead of spawned (bench/forkshim/sitecustomize.py on
  the server's PYTHONPATH, STARTBENCH_FORK=1): no second import of torch + vLLM;
- `nolora-mnbt512`: a 512-token warm-up forward instead of 2,048 (`--max-num-batched-tokens 512`);
- `block128`: vLLM-CPU's own 128-token KV block (tidal's CPU default is 32 since issue 68; `tidal grpo` rows).

A start that does not answer within 150 s, or a burst over 120 s, is reported as failed and the invocation goes on
(a forked process can hang on inherited OpenMP state). Run under the heavy-work lock:

    PYTHONPATH=src python bench/startup_cuts.py --variants nolora,nolora-fork,nolora-mnbt512 \
        --configs examples/real_model --requests 32 --tokens 48
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_startup as vs  # noqa: E402 - the one start-up bench; this adds variants to it

SHIM = Path(__file__).resolve().parent / "forkshim"
_wait, _burst, _time_start = vs.harness.wait_ready, vs.burst, vs.time_start


def ready_capped(child: Any, url: str, budget_s: float, started: float | None = None, poll_s: float = 0.5) -> float:
    return _wait(child, url, min(budget_s, 150.0), started, poll_s)


async def burst(*args: Any, **kwargs: Any) -> float:
    return await asyncio.wait_for(_burst(*args, **kwargs), 120.0)


def time_start(variant: vs.Variant, *args: Any, **kwargs: Any) -> vs.Run:
    """bench/vllm_startup.py's start, a failure reported as a row instead of ending the invocation."""
    try:
        return _time_start(variant, *args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure of one variant is its row
        print(f"[startup_cuts] {variant.name}: FAILED {exc!r}", flush=True)
        return vs.Run(f"{variant.name}-FAILED", float("nan"), {"ready": float("nan")}, [0.0] * 4, (0.0, 0.0, 0.0), 0)


def main() -> None:
    vs.harness.wait_ready, vs.burst, vs.time_start = ready_capped, burst, time_start
    base = vs.VARIANTS["nolora"]
    vs.VARIANTS["nolora-fork"] = dataclasses.replace(base, name="nolora-fork", src=f"{SHIM}:{base.src}",
                                                     env={**base.env, "STARTBENCH_FORK": "1"})
    vs.VARIANTS["nolora-mnbt512"] = dataclasses.replace(
        base, name="nolora-mnbt512", args=[*base.args, "--infer.extra_args", '["--max-num-batched-tokens", "512"]'])
    vs.VARIANTS["block128"] = dataclasses.replace(vs.VARIANTS["default"], name="block128",
                                                  args=["--infer.block_size", "128"])
    vs.main()


if __name__ == "__main__":
    main()
