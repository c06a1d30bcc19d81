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
metric on those vectors). The rule, `judge`: the served policy is wrong when its distance to the new policy,
`gap_new`, exceeds the tolerance of the trainer's dtype (`TOLERANCE`; float32 0.01, bf16/fp16 0.1). The other
half of the rule in issue 66, "closer to the previous policy (or the base) than to the new one", is not a second
trigger: with a tiny learning rate the new and the previous policy are closer than the numerical noise, the
served one is then "closer" to either by chance, and a trigger on it would false-alarm. With a metric it needs
none: when the new policy moved more than twice the tolerance from a stale one and `gap_new` <= tolerance, the
triangle inequality puts the served policy farther than the tolerance from the stale one, so it cannot be
closer to it; when it moved less, the probe cannot tell the two apart and says nothing. Which stale policy the
served one is closest to is the diagnosis in the message. A sampler stuck on the base model while the policy
drifts is caught as soon as the drift exceeds the tolerance, since `base` is compared every time.

Torch-free (the orchestrator imports it); the trainer computes the logprobs (`tidal.trainer.publish.probe`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

PROBE_FILE = "probe.json"
PROBE_LEN = 32
"""Tokens in the probe: one short forward on each side (bench/policy_check.py: its cost beside a step)."""
TOLERANCE = {"float32": 0.01, "bfloat16": 0.1, "float16": 0.1}
"""The largest mean |logprob difference| between trainer and sampler that is numerical, per the trainer's dtype
(the served copy is no more precise). float32 on CPU: the matrix architectures stay below a tenth of it on every
path (tests/integration/test_arch_matrix.py), the bundled run's gaps are in bench/POLICY_CHECK.md; a 16-bit GPU
pair has never run (bench/gpu_ledger.json, row policy-check): 0.1 is a guess until then."""


class PolicyMismatch(RuntimeError):
    """The sampler serves something other than the policy it reported loaded (one line: step, path, distances)."""


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

    @property
    def ok(self) -> bool:
        return self.gap_new <= self.tolerance

    def diagnosis(self) -> str:
        """Which policy the served one is: a stale one within the tolerance, else none of the trainer's (a partial
        load, weights of another model)."""
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


def judge(served: list[float], record: ProbeRecord, tol: float) -> Verdict:
    """Compare the served probe logprobs with the record's policies (the rule: the module's docstring)."""
    return Verdict(gap_new=distance(served, record.new),
                   gap_previous=None if record.previous is None else distance(served, record.previous),
                   gap_base=None if record.base is None else distance(served, record.base), tolerance=tol)
