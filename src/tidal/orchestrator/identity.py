"""The policy identity check: after a sampler reports policy n loaded, score the probe the trainer published with it
through the sampler and stop when the sampler serves something else (`tidal.transport.probe`: the probe, the
distance, the rule and why it cannot false-alarm on a step that barely moved the policy).

One function, `check_served`, for every path that hands a new policy to a sampler: `tidal grpo`'s LoRA loads,
merged reloads and weight pushes (`IdentityCheck`, from `tidal.orchestrator.policy.PolicyTracker` after every
load, on every server), the Tinker service's sampler checkpoints (`tidal.tinker.service`) and `tidal eval`'s
rows (`tidal.evaluate.run`). A scorer is any coroutine function ids -> prompt logprobs
(`InferenceClient.prompt_logprobs` for `tidal grpo` and `tidal eval`, the Tinker sampler's own for Tinker). Cost:
one prompt-logprobs request of `PROBE_LEN` tokens per server and policy (bench/policy_check.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from tidal.inference.protocol import InferenceClient
from tidal.transport.probe import PolicyMismatch, ProbeRecord, Verdict, judge, tolerance

log = logging.getLogger("tidal.orch")

Scorer = Callable[[list[int]], Awaitable[list[float]]]

__all__ = ["IdentityCheck", "PolicyMismatch", "Scorer", "check_served"]


async def check_served(score: Scorer, record: ProbeRecord, *, what: str, path: str, off: str,
                       tol: float | None = None, times: int = 1, context: int | None = None,
                       earlier: dict[int, list[float]] | None = None) -> Verdict:
    """Score `record`'s probe `times` times through `score` (a round-robin client: once per server) and judge each
    answer; raises `PolicyMismatch` (one line: the step, `path`, the distances; `off`: the key that turns the check
    off) on the first wrong one, else returns the verdict with the largest gap to the new policy. `context`: the
    sampler's longest sequence, when it may be shorter than the probe (its first tokens are scored then);
    `earlier`: policies checked before (`judge`)."""
    record = record.prefix(len(record.ids) if context is None else max(2, context - 1))
    earlier = {k: v[:len(record.ids)] for k, v in (earlier or {}).items()}
    worst: Verdict | None = None
    for _ in range(max(times, 1)):
        v = judge(await score(record.ids), record, tolerance(record.dtype, tol), earlier)
        if not v.ok:
            raise PolicyMismatch(v.line(what, record.step, path, off))
        if worst is None or v.gap_new > worst.gap_new:
            worst = v
    assert worst is not None
    return worst


class IdentityCheck:
    """`tidal grpo`'s check after each policy load (orch `weight_broadcast.policy_check`), and its metrics."""

    OFF = "orch weight_broadcast.policy_check: false"
    EARLIER = 8
    """Policies checked before that each check also places the served one against (`judge`'s `earlier`): a sampler
    stuck on one of them is caught within 1-4 steps under bf16 (bench/PROBE-68.md)."""

    def __init__(self, enabled: bool = True, tol: float | None = None, context: int | None = None) -> None:
        """`context`: orch `seq_len`, which the servers hold (`tidal grpo` refuses an infer `max_model_len` below it):
        a longer probe is scored on its first tokens (`check_served`)."""
        self.enabled, self.tol, self.context = enabled, tol, context
        self.gap = 0.0  # the served policy's distance to the one it should be (0: policy 0, the server's own)
        self.time_s = 0.0
        self.unchecked: set[int] = set()
        self.earlier: dict[int, list[float]] = {}  # step -> probe logprobs of the last EARLIER policies checked

    async def after_load(self, client: InferenceClient, model: str, policy_dir: Path, step: int) -> None:
        """Policy `step` (from `policy_dir`) is loaded on every server of `client` as `model`: check each."""
        if not self.enabled:
            return
        record = ProbeRecord.read(policy_dir)
        if record is None:  # a QeRL trainer, a policy republished on resume, a trainer before issue 66
            if step not in self.unchecked:
                log.warning("policy %d has no identity probe (%s): not checked", step, policy_dir)
            self.unchecked.add(step)
            return
        t0 = time.monotonic()
        v = await check_served(lambda ids: client.prompt_logprobs(model, ids), record, what="the inference server",
                               path=str(policy_dir), off=self.OFF, tol=self.tol, times=len(client.urls),
                               earlier={k: v for k, v in self.earlier.items() if k < step}, context=self.context)
        self.earlier[step] = record.new
        while len(self.earlier) > self.EARLIER:
            del self.earlier[min(self.earlier)]
        self.gap, self.time_s = v.gap_new, self.time_s + time.monotonic() - t0
        log.info("policy %d identity check: probe gap %.3g (previous %s, base %s, tolerance %g)%s", step, v.gap_new,
                 "n/a" if v.gap_previous is None else f"{v.gap_previous:.3g}",
                 "n/a" if v.gap_base is None else f"{v.gap_base:.3g}", v.tolerance, v.placed())

    def metrics(self) -> dict[str, float]:
        """`policy/probe_gap` (the served policy's distance to the trainer's) and the check's time since the last
        call (`policy/probe_time_s`); {} when the check is off."""
        if not self.enabled:
            return {}
        out = {"policy/probe_gap": self.gap, "policy/probe_time_s": self.time_s}
        self.time_s = 0.0
        return out
