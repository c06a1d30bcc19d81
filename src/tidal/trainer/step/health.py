"""The mismatch guard: notice when trainer and inference disagree about the sampled tokens, and say why.

After every step the trainer hands `mismatch_kl` and `token_mult_prob_error` to `MismatchGuard.check`. Both
compare the trainer's logprobs at the start of the step with vLLM's: on on-policy steps (step 1 always) the
gap is purely numerical; on off-policy steps it also holds the policy's own movement since sampling, so by
default (`scope: on_policy`) only on-policy steps are judged. (The default example's off-policy steps reach
token_mult_prob_error 1.1 at lr 2e-3 with nothing wrong.) When
either stays above its threshold for `patience` consecutive steps the guard logs a warning listing the usual
causes (once per episode; it re-arms when the metrics come back down) and, with `action: stop`, raises
`MismatchError`, which ends the trainer with exit code 1. None of the reference systems has one.
"""

from __future__ import annotations

import logging
from typing import Any

from tidal.config.train import MismatchGuardConfig

log = logging.getLogger("tidal.trainer")

CAUSES = """likely causes:
  - dtype: trainer and vLLM compute in different precisions (infer `dtype` vs train `recipe`; on CPU both
    should be float32);
  - temperature: the trainer scores at the batch's sampling temperature; a sampler that changes the
    distribution (top_p/top_k, repetition penalty) makes vLLM's logprobs differ from the trainer's;
  - stale adapter: vLLM still serves an older adapter than the batch says (check `policy_step` and the
    orchestrator's adapter loads in its log);
  - tokenization: completions re-tokenized from text instead of the sampled token ids, or a chat template
    that differs between the trainer and vLLM."""


class MismatchError(RuntimeError):
    """The guard's `action: stop` fired."""


class MismatchGuard:
    def __init__(self, cfg: MismatchGuardConfig) -> None:
        self.cfg = cfg
        self.streak = 0
        self.warned = False

    def check(self, step: int, metrics: dict[str, Any]) -> str | None:
        """Update with one step's metrics; returns the warning text when it fires (else None)."""
        if not self.cfg.enabled:
            return None
        if self.cfg.scope == "on_policy" and int(metrics.get("off_policy_level", 0)) > 0:
            return None  # the gap would also hold the policy's own movement since sampling
        kl = float(metrics.get("mismatch_kl", 0.0))
        err = float(metrics.get("token_mult_prob_error", 1.0))
        high = kl > self.cfg.max_mismatch_kl or err > self.cfg.max_token_mult_prob_error
        self.streak = self.streak + 1 if high else 0
        if not high:
            self.warned = False
        if self.streak < self.cfg.patience or (self.warned and self.cfg.action == "warn"):
            return None
        self.warned = True
        lag = int(metrics.get("off_policy_level", 0))
        msg = (f"step {step}: trainer/inference mismatch above threshold for {self.streak} steps "
               f"(mismatch_kl {kl:.3g} > {self.cfg.max_mismatch_kl:g} or token_mult_prob_error {err:.4f} > "
               f"{self.cfg.max_token_mult_prob_error:g}); {CAUSES}")
        if lag:
            msg += (f"\n  - policy change: these rollouts are {lag} update(s) old, so part of the gap is the "
                    f"policy moving (a high learning rate or max_async_level)")
        log.warning(msg)
        if self.cfg.action == "stop":
            raise MismatchError(msg + "\n(train.mismatch_guard.action is 'stop')")
        return msg
