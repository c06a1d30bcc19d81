"""Where a training step's time goes, by kind (issue 43): `bench/gpu_trainer.py --profile` runs `train_step` under
`torch.profiler` and this module turns the trace into one table whose rows add up to the step's wall time.

Rows (`KINDS`): base matmuls, LoRA matmuls, attention forward, attention backward, norms / activations / RoPE /
other elementwise (copies included), recomputation (everything a checkpoint recomputes in the backward), the
logprob / LM-head pass (the chunked lm_head, log-softmax and their backward), the optimizer (gradient clipping,
AdamW, zero_grad), and host gaps = wall - device busy.

How a span of time gets its row: on CUDA the spans are the device's kernels (and copies), each with the CPU op that
launched it (the profiler's correlation id) and that op's ancestors; on CPU they are the `aten::` ops themselves.
At each instant the busy time goes to one span (the innermost one running: the latest started), so the rows but
the last sum to the union of the spans, "device busy", exactly; host gaps is the rest of the wall time, the time
the device waited for Python (or, on CPU, the time outside any aten op). A span's row is the first that matches,
in this order (`classify`):
1. optimizer: under `OPTIMIZER` (tidal's range around clip + step + zero_grad) or torch's `Optimizer.*`;
2. recomputation: under `RECOMPUTE` (tidal's checkpointed functions label their second run, in the backward);
3. logprob / LM-head: under `LM_HEAD` (the chunked logprob Function's forward and backward);
4. attention: under `ATTENTION` (tidal's attention kernels, forward), or an op / autograd node / kernel named
   like attention (scaled_dot_product, flash, fmha, flex, cudnn attention; without compiled layers, dynamo's
   `CompiledFunctionBackward` too: flex's compiled kernel is then the only compiled graph with a backward);
   backward when under an autograd node (`autograd::engine::evaluate_function`, `*Backward*`);
5. matmuls: mm / addmm / bmm / linear / matmul / scaled_mm ops (kernels named gemm, cutlass, xmma, nvjet too):
   LoRA when one of its input dimensions is the LoRA rank (the A and B matrices), base otherwise;
6. everything else: elementwise.
These rules read names torch and its kernels give; on CUDA they are unverified until a GPU run (bench/GPU.md).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

RECOMPUTE = "tidal::recompute"
"""`record_function` range of a checkpointed function's recompute (`tidal.trainer.model.activations`)."""
LM_HEAD = "tidal::lm_head"
"""`record_function` range of the chunked logprob pass, forward and backward (`tidal.trainer.step.logprobs`)."""
OPTIMIZER = "tidal::optimizer"
"""`record_function` range of gradient clipping, the optimizer step and zero_grad (`tidal.trainer.grpo`)."""
ATTENTION = "tidal::attention"
"""`record_function` range of tidal's attention kernels' forward (`tidal.trainer.model.attention.register`)."""
STEP = "tidal::profiled_step"
"""`record_function` range of one profiled training step (`profile_steps`): its wall time."""

KINDS = ("base matmuls", "LoRA matmuls", "attention forward", "attention backward",
         "norms, activations, RoPE, other elementwise", "recomputation (checkpoint)", "logprob / LM-head pass",
         "optimizer", "host gaps (wall - device busy)")
"""The table's rows, in order; the last is wall time minus the union of the spans."""
HOST_GAP = KINDS[-1]

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
              "aten::_scaled_mm", "aten::addmv", "aten::mv")
MATMUL_KERNELS = ("gemm", "cutlass", "xmma", "nvjet", "cublas")
ATTENTION_WORDS = ("scaled_dot_product", "flash", "fmha", "flex", "cudnn_attention", "attention")


@dataclass(frozen=True)
class Span:
    """One interval of busy time (microseconds): a kernel or an op, with the names of what it ran under (itself
    first, then its launching op and that op's ancestors, innermost first) and the input shapes of its op."""

    start: float
    end: float
    labels: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...] = ()


def classify(span: Span, lora_rank: int | None, compiled_layers: bool = False) -> str:
    """The row of `span` (module doc, rules 1-6)."""
    labels = span.labels
    low = [x.lower() for x in labels]
    if OPTIMIZER in labels or any(x.startswith("Optimizer.") for x in labels):
        return "optimizer"
    if RECOMPUTE in labels:
        return "recomputation (checkpoint)"
    if LM_HEAD in labels:
        return "logprob / LM-head pass"
    backward = any("evaluate_function" in x or "backward" in x for x in low)
    attention = ATTENTION in labels or any(w in x for x in low for w in ATTENTION_WORDS) or (
        backward and not compiled_layers and any("compiledfunctionbackward" in x for x in low))
    if attention:
        return "attention backward" if backward else "attention forward"
    if any(x in MATMUL_OPS for x in labels) or any(k in low[0] for k in MATMUL_KERNELS):
        lora = lora_rank is not None and any(lora_rank in s for s in span.shapes)
        return "LoRA matmuls" if lora else "base matmuls"
    return "norms, activations, RoPE, other elementwise"


def attribute(spans: Sequence[Span], lo: float, hi: float, lora_rank: int | None,
              compiled_layers: bool = False) -> dict[str, float]:
    """Microseconds per row (`KINDS`) of the wall interval [lo, hi]: each instant of busy time to the innermost
    (latest started) span running then; host gaps = (hi - lo) - busy."""
    kinds = [classify(s, lora_rank, compiled_layers) for s in spans]
    order = sorted((i for i, s in enumerate(spans) if min(s.end, hi) > max(s.start, lo)), key=lambda i: spans[i].start)
    out = dict.fromkeys(KINDS, 0.0)
    points = sorted({lo, hi, *(max(spans[i].start, lo) for i in order), *(min(spans[i].end, hi) for i in order)})
    active: list[tuple[float, float, int]] = []  # (-start, end, index): the top is the latest started
    nxt = 0
    for a, b in zip(points, points[1:], strict=False):
        while nxt < len(order) and max(spans[order[nxt]].start, lo) <= a:
            i = order[nxt]
            heapq.heappush(active, (-spans[i].start, spans[i].end, i))
            nxt += 1
        while active and active[0][1] <= a:  # ended (lazily: only those on top matter)
            heapq.heappop(active)
        if active:
            out[kinds[active[0][2]]] += b - a
    busy = sum(v for k, v in out.items() if k != HOST_GAP)
    out[HOST_GAP] = (hi - lo) - busy
    return out


def _names(evt: Any) -> list[str]:
    """`evt`'s name and its CPU ancestors' names, innermost first."""
    out = []
    while evt is not None:
        out.append(str(evt.name))
        evt = evt.cpu_parent
    return out


def _shapes(evt: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(d) for d in s) for s in (getattr(evt, "input_shapes", None) or []) if isinstance(s, list))


def spans_of(events: Iterable[Any], cuda: bool) -> tuple[list[Span], list[tuple[float, float]]]:
    """(busy spans, wall intervals of the `STEP` ranges) of a profiler's events (`prof.events()`): CUDA kernels and
    copies with their launching op's ancestry (`cuda`), else the CPU `aten::` ops."""
    from torch.autograd import DeviceType

    events = list(events)
    steps = [(e.time_range.start, e.time_range.end) for e in events if e.name == STEP
             and e.device_type == DeviceType.CPU]
    spans = []
    if cuda:
        launchers = {e.id: e for e in events if e.device_type == DeviceType.CPU and not e.linked_correlation_id}
        for e in events:
            if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
                continue
            op = launchers.get(e.linked_correlation_id)
            labels = (str(e.name), *(_names(op) if op is not None else []))
            spans.append(Span(e.time_range.start, e.time_range.end, labels, _shapes(op) if op is not None else ()))
    else:
        for e in events:
            if e.device_type == DeviceType.CPU and str(e.name).startswith("aten::"):
                spans.append(Span(e.time_range.start, e.time_range.end, tuple(_names(e)), _shapes(e)))
    return spans, steps


def breakdown(events: Iterable[Any], cuda: bool, lora_rank: int | None, compiled_layers: bool = False,
              ) -> dict[str, Any]:
    """Seconds per row (`KINDS`) per profiled step (the mean over the `STEP` ranges) and the wall time per step."""
    spans, steps = spans_of(events, cuda)
    if not steps:
        raise ValueError(f"no {STEP} range in the profile: run the steps under profile_steps")
    rows = dict.fromkeys(KINDS, 0.0)
    for lo, hi in steps:
        for k, v in attribute(spans, lo, hi, lora_rank, compiled_layers).items():
            rows[k] += v / 1e6 / len(steps)
    wall = sum(hi - lo for lo, hi in steps) / 1e6 / len(steps)
    return {"rows": rows, "wall_s": wall, "steps": len(steps), "spans": len(spans)}


def profile_steps(step: Any, n: int, cuda: bool) -> Any:
    """Run `step()` `n` times under `torch.profiler` (input shapes recorded), each in a `STEP` range that ends after
    the device finished (CUDA synchronized); returns the profiler's events."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(n):
            with record_function(STEP):
                step()
                if cuda:
                    torch.cuda.synchronize()
    return prof.events()


def markdown(result: dict[str, Any]) -> list[str]:
    """The table: one line per row (ms per step, share of the wall time), then the wall time."""
    wall = result["wall_s"]
    out = ["| kind | ms per step | share of the step |", "|---|---|---|"]
    for k in KINDS:
        v = result["rows"][k]
        out.append(f"| {k} | {1e3 * v:.2f} | {100 * v / wall if wall else 0.0:.1f}% |")
    out.append(f"| **wall time** | **{1e3 * wall:.2f}** | 100% |")
    return out
