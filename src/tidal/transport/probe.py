"""The policy identity probe: what the trainer publishes with policy n so that a sampler can be checked to serve it.

A rollout sampled by a policy other than the one the trainer thinks (an adapter load that did nothing, a merged
reload of an empty file, a weight push whose tensors were dropped) trains "fine" and learns nothing for as long
as nobody looks (verl#7495, unsloth#8701, ms-swift#9855). So with each policy the trainer publishes its logprobs of
a small fixed token sequence, the *probe* (`probe.json` inside `broadcasts/step_n/`, written before the
directory's `STABLE`), together with the logprobs of the policy it published before and of the base model. Once
a sampler says it serves policy n, the caller scores the same probe through the sampler (prompt logprobs) and
`judge` compares (`tidal.orchestrator.identity` does both, for `tidal grpo`, the Tinker service and
`tidal eval`).

Distance: the mean absolute difference of the per-token logprobs over the probe's tokens after the first (a
metric on those vectors). The rule, `judge`, has two triggers:

1. **Too far from the new policy**: `gap_new`, the distance to policy n, exceeds the tolerance of the trainer's dtype
   (`TOLERANCE`; float32 0.01, bf16/fp16 0.1): a partial load, another model's weights, a stale policy far away.
2. **Resolved at a stale policy**: for each stale policy the record holds (the previous one, the base), the served
   logprobs are projected on the line from the stale policy's (0) to the new one's (1): `position` =
   <served - stale, new - stale> / |new - stale|^2, and the *resolution* says whether that placement can be
   trusted: >= 1 when the two policies are farther apart than the served noise (mean |new - stale| over the mean
   residual, the residual being what the projection leaves: numerical noise whichever of the two is served) and
   the position's standard error is <= 0.1. A served policy whose position is below 1/2 at a resolution >=
   `RESOLVED` (1) is the stale one. This is what tells policy n from
   k under a 16-bit sampler, where the served noise (~0.04 on CPU in bf16) exceeds one step's move (~0.01-0.02)
   and so the distance alone cannot (bench/PROBE-68.md: real bf16 vLLM logprobs of 15 policies of a SmolLM2 run;
   at resolution >= 1 and 128 tokens the served policy sat at 0.73 or above, a stale one at 0.21 or below, over
   120 pairs).

Neither trigger can false-alarm on a step that barely moved the policy: the distance stays within the tolerance,
and the resolution of a move smaller than the noise is below 1, so the probe then says nothing (which is right:
no probe can tell them apart). A step that did not move the policy at all (a skipped zero-gradient step) has
nothing to project on. A sampler stuck on the base is caught as soon as the policy has moved one noise width from
it, since `base` is compared every time; one stuck on an earlier policy k likewise when the caller passes the
policies it checked before (`judge`'s `earlier`; `tidal grpo` passes its last 8). One step's staleness (n - 1
served as n) under a 16-bit sampler moves less than the noise and is not caught (in float32 it is, at once).

Torch-free (the orchestrator imports it); the trainer computes the logprobs (`tidal.trainer.publish.probe`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

PROBE_FILE = "probe.json"
PROBE_LEN = 32
"""Tokens in the probe of a float32 policy: one short no-grad forward on each side (bench/policy_check.py: its cost
beside a step); a float32 sampler sits ~1e-5 from it, so 32 tokens resolve any move the check can act on."""
PROBE_LEN_16BIT = 128
"""Tokens in the probe of a policy computed in 16 bits (train `recipe: bf16`, on CPU its autocast too), whose
sampler's noise (~0.04 a token) exceeds one step's move: the projection needs more tokens to keep a served policy
away from the stale end and place it tightly enough to be trusted. bench/PROBE-68.md, replaying a bf16 vLLM's
logprobs of 15 policies: at 32 tokens few placements are trusted (a sampler stuck on the base caught after 8 steps),
at 128 a served policy sat at 0.73 or more and a stale one at 0.21 or less, stuck samplers caught within 1-4 steps;
256 barely better (0.75 / 0.09) for twice the cost (~0.8 s a step on 2 cores for SmolLM2-135M in float32)."""
RESOLVED = 1.0
"""Resolution (`position`) from which `judge` trusts the projection (module doc)."""
POSITION_SE = 0.1
"""The standard error of a position `judge` trusts: 1/2, the threshold, is then 5 of them from either end."""
TOLERANCE = {"float32": 0.01, "bfloat16": 0.1, "float16": 0.1}
"""The largest mean |logprob difference| between trainer and sampler that is numerical, per the trainer's dtype
(the served copy is no more precise). float32 on CPU: the matrix architectures stay below a tenth of it on every
path (tests/integration/test_arch_matrix.py), the bundled run's gaps are in bench/POLICY_CHECK.md; a 16-bit GPU
pair has never run (bench/gpu_ledger.json, row policy-check): 0.1 is a guess until then."""


class PolicyMismatch(RuntimeError):
    """The sampler serves something other than the policy it reported loaded (one line: step, path, distances)."""


def probe_length(context: int | None, dtype: str = "float32") -> int:
    """The probe's length for a policy computed in `dtype` (`PROBE_LEN`, `PROBE_LEN_16BIT` for a 16-bit one) and a
    context of `context` tokens (train `sequence_len`, vLLM's `max_model_len`: the prompt-logprobs request generates
    one token), fewer where the context is shorter; None: no limit known."""
    n = PROBE_LEN if dtype == "float32" else PROBE_LEN_16BIT
    return n if context is None else max(2, min(n, context - 1))


def probe_ids(vocab_size: int, length: int = PROBE_LEN) -> list[int]:
    """A fixed sequence of `length` token ids in [3, vocab_size) (past the usual bos/eos/pad ids), spread over the
    vocabulary by a fixed multiplicative walk: the same for every run, no tokenizer needed."""
    span = max(vocab_size - 3, 1)
    return [3 + (7919 * (i + 1) * (i + 3)) % span for i in range(length)]


@dataclass
class ProbeRecord:
    """What the trainer publishes with policy `step` (`probe.json`)."""

    step: int
    ids: list[int]
    new: list[float]
    """Policy `step`'s untempered logprob of each probe token given the ones before (the first: 0)."""
    dtype: str
    """The trainer's compute dtype (`TOLERANCE`'s key)."""
    previous: list[float] | None = None
    """The same for the policy the trainer published before (None: none, e.g. the first after the base)."""
    previous_step: int | None = None
    base: list[float] | None = None
    """The same for the base model (None: unknown, e.g. a fully fine-tuned policy resumed without a reference)."""

    def write(self, directory: Path) -> None:
        """Into `directory` (a policy's temp directory, before its STABLE)."""
        (directory / PROBE_FILE).write_text(json.dumps(asdict(self)))

    def prefix(self, length: int) -> ProbeRecord:
        """The record of the probe's first `length` tokens (logprobs are causal: the same values), for a sampler whose
        context is shorter than the probe."""
        if length >= len(self.ids):
            return self
        cut = lambda v: None if v is None else v[:length]  # noqa: E731
        return ProbeRecord(step=self.step, ids=self.ids[:length], new=self.new[:length], dtype=self.dtype,
                           previous=cut(self.previous), previous_step=self.previous_step, base=cut(self.base))

    @classmethod
    def read(cls, directory: Path) -> ProbeRecord | None:
        """The record of the policy directory `directory`; None when it has none."""
        try:
            return cls(**json.loads((directory / PROBE_FILE).read_text()))
        except FileNotFoundError:
            return None


def distance(a: list[float], b: list[float]) -> float:
    """Mean |a - b| over the positions after the first (whose logprob is 0 by convention)."""
    if len(a) != len(b):
        raise ValueError(f"probe logprobs of different lengths: {len(a)} vs {len(b)}")
    if len(a) < 2:
        return 0.0
    return sum(abs(x - y) for x, y in zip(a[1:], b[1:], strict=True)) / (len(a) - 1)


def position(served: list[float], stale: list[float], new: list[float]) -> tuple[float, float]:
    """(position, resolution) of `served` on the line from `stale` (0) to `new` (1), over the positions after the
    first. position = <served - stale, new - stale> / |new - stale|^2. The residual (what the projection leaves) is
    the served noise; resolution = the smaller of (a) mean |new - stale| over mean |residual| (the move against the
    noise: below 1 the noise's own structure can fake a move, bench/PROBE-68.md) and (b) `POSITION_SE` over the
    position's standard error (rms residual / |new - stale|: on a short probe a move near the noise is placed
    loosely). So resolution >= 1 says: the move exceeds the noise and the position is known to +-0.1. (0.0, 0.0)
    when new == stale (nothing to tell apart); an exact fit has infinite resolution."""
    d = [n - s for n, s in zip(new[1:], stale[1:], strict=True)]
    x = [v - s for v, s in zip(served[1:], stale[1:], strict=True)]
    dd = sum(v * v for v in d)
    if dd == 0.0:
        return 0.0, 0.0
    pos = sum(a * b for a, b in zip(x, d, strict=True)) / dd
    r = [a - pos * b for a, b in zip(x, d, strict=True)]
    noise = sum(abs(v) for v in r)
    if noise == 0.0:
        return pos, math.inf
    se = math.sqrt(sum(v * v for v in r) / max(len(r) - 1, 1) / dd)
    return pos, min(sum(abs(v) for v in d) / noise, POSITION_SE / se)


def tolerance(dtype: str, override: float | None = None) -> float:
    """The check's tolerance: `override` when given, else `TOLERANCE[dtype]` (an unknown dtype: the 16-bit one)."""
    return override if override is not None else TOLERANCE.get(dtype, TOLERANCE["bfloat16"])


@dataclass(frozen=True)
class Verdict:
    """`judge`'s answer: the distances and whether the served policy is the new one."""

    gap_new: float
    gap_previous: float | None
    gap_base: float | None
    tolerance: float
    placements: tuple[tuple[str, float, float], ...] = ()
    """(stale policy, position, resolution) of the served logprobs on the line from each stale policy ("the previous
    policy", "the base model", "policy k" checked before) to the new one (`position`; the module doc's second
    trigger)."""

    @property
    def resolved_at(self) -> tuple[str, float, float] | None:
        """Of the placements that put the served policy at the stale end (resolution >= `RESOLVED`, position below
        1/2), the one it sits closest to (position nearest 0: a served base also sits behind the previous policy, a
        served previous policy part way from the base); None: none does."""
        at = [p for p in self.placements if p[2] >= RESOLVED and p[1] < 0.5]  # a tie (the previous is the base): base
        return min(at, key=lambda p: (round(abs(p[1]), 9), p[0] != "the base model")) if at else None

    @property
    def ok(self) -> bool:
        return self.gap_new <= self.tolerance and self.resolved_at is None

    def placed(self) -> str:
        """The placements in words for the log (`""`: none), e.g. "; position 0.97 from the previous policy
        (resolution 1.3), 1.00 from the base model (resolution 45)"."""
        parts = [f"{pos:.2f} from {name} (resolution {res:.2g})" for name, pos, res in self.placements
                 if res > 0 and not name.startswith("policy ")]
        return "; position " + ", ".join(parts) if parts else ""

    def diagnosis(self) -> str:
        """Which policy the served one is: the stale one the projection resolved it at, a stale one within the
        tolerance, else none of the trainer's (a partial load, weights of another model)."""
        at = self.resolved_at
        if at is not None:
            who = at[0] if abs(at[1]) <= 0.25 else "an older policy than the new one"  # part way: between the two
            return (f"it serves {who}: its logprobs sit at {at[1]:.2f} on the line from {at[0]} at 0 to the new "
                    f"policy at 1, resolution {at[2]:.2g}")
        stale = {k: v for k, v in (("the base model", self.gap_base), ("the previous policy", self.gap_previous))
                 if v is not None}
        closest = min(stale, key=lambda k: stale[k]) if stale else None  # a tie (the previous is the base): base
        if closest is not None and stale[closest] <= self.tolerance:
            return f"it serves {closest}"
        return "it serves none of the trainer's policies" + (f" (closest: {closest})" if closest else "")

    def line(self, what: str, step: int, path: str, off: str) -> str:
        """The one-line error: step, path and both distances; `off`: the key that turns the check off."""
        prev = "n/a" if self.gap_previous is None else f"{self.gap_previous:.4g}"
        base = "n/a" if self.gap_base is None else f"{self.gap_base:.4g}"
        return (f"policy identity check failed at step {step}: {what} reported policy {step} loaded from {path} "
                f"but its probe logprobs are {self.gap_new:.4g} from it (tolerance {self.tolerance:g}), {prev} from "
                f"the previous policy and {base} from the base: {self.diagnosis()} (turn the check off with {off} only "
                f"if the sampler changes the weights on purpose)")


def judge(served: list[float], record: ProbeRecord, tol: float,
          earlier: dict[int, list[float]] | None = None) -> Verdict:
    """Compare the served probe logprobs with the record's policies (the rule: the module's docstring). `earlier`:
    the logprobs of policies checked before (step -> logprobs of the same probe), placed like the previous one: a
    sampler stuck on policy k is then caught once policy n has moved a noise width from k (bench/PROBE-68.md, a bf16
    sampler: within 1-4 steps for every k <= 11 of a 15-step run, where the distance alone took 6-9 steps for
    k <= 9 and never caught k = 10 or 11)."""
    stale = [("the previous policy", record.previous), ("the base model", record.base)]
    stale += [(f"policy {k}", lps) for k, lps in sorted((earlier or {}).items())
              if k not in (record.step, record.previous_step, 0) and len(lps) == len(record.new)]
    placements = tuple((name, *position(served, lps, record.new)) for name, lps in stale if lps is not None)
    return Verdict(gap_new=distance(served, record.new),
                   gap_previous=None if record.previous is None else distance(served, record.previous),
                   gap_base=None if record.base is None else distance(served, record.base), tolerance=tol,
                   placements=placements)
