"""The GRPO policy loss section of the trainer config (train `loss`): seed 000's `aipo` and TRL 1.16's loss types,
importance-sampling corrections, masks and KL terms. Pure user input (formulas: docs/algorithms.md; the loss itself:
`tidal.trainer.step.loss`)."""

from __future__ import annotations

import warnings
from typing import Literal

from pydantic import Field, model_validator

from tidal.config.base import ConfigWarning, StrictModel

LOSS_TYPES = ("aipo", "grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CLIPPED_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
"""TRL's PPO-clipped objective `min(r A, clip(r) A)`; `luspo` differs by its normalization only."""
TRL_TYPES = (*CLIPPED_TYPES, "cispo", "sapo", "vespo")
"""The loss types of TRL 1.16 (every one but seed 000's `aipo`)."""
AIPO_ONLY = ("ratio_type", "kl_tau", "sequence_clip_high")
CLIPPED_ONLY = ("epsilon", "epsilon_high", "delta", "importance_sampling_level", "ratio_clip_c",
                "is_correction", "is_cap", "is_cap_min", "off_policy_mask_threshold", "use_bias_correction_kl")
TYPE_KEYS = {"sapo": ("sapo_temperature_pos", "sapo_temperature_neg"),
             "vespo": ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")}
"""Keys only one loss type reads."""


class LossConfig(StrictModel):
    """The policy loss. `loss_type: aipo` (default) is seed 000's loss; `grpo|bnpo|dr_grpo|dapo` are TRL's
    clipped objectives with TRL's normalizations, plus NeMo RL's dual clip and importance-sampling correction.
    Formulas: docs/algorithms.md."""

    loss_type: Literal["aipo", "grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = "aipo"
    """`aipo`: seed 000's importance-weighted policy gradient (ratio to the inference policy, detached
    coefficient, token-mean over the step). `grpo`: clipped objective, mean over tokens per sequence then over
    sequences. `bnpo`: token-mean per micro-batch, averaged over micro-batches. `dr_grpo`: token sum divided by
    sequences x max completion tokens. `dapo`: token-mean over the whole step. TRL 1.16's others: `cispo`
    (MiniMax-M1: detached ratio capped at `epsilon_high` times `A * lp`, token-mean over the step), `sapo` (soft
    sigmoid gate, `sapo_temperature_*`, normalized like grpo), `luspo` (clipped objective, token sum per
    sequence averaged over sequences), `vespo` (Gamma-weighted sequence ratio times `A * lp`, `vespo_*`,
    token-mean over the step)."""
    ratio_type: Literal["token", "sequence"] = "token"
    """(aipo) Importance-ratio granularity: per token, or one ratio per sequence (geometric mean of its token
    ratios, clipped at `sequence_clip_high`)."""
    kl_tau: float = Field(0.0, ge=0)
    """(aipo) KL penalty coefficient on `log_ratio` (trainer vs inference policy)."""
    adv_tau: float = Field(1.0, ge=0)
    """Advantage scaling factor (all loss types)."""
    teacher_tau: float = Field(0.0, ge=0)
    """Teacher KL distillation coefficient: adds `teacher_tau * (teacher_logprob - trainer_logprob)` to every
    token's advantage. Needs teacher logprobs in the batch (orch `teacher`)."""
    token_mask_low: float = Field(0.125, ge=0)
    """Mask a token whose trainer/inference probability ratio is below this (all loss types)."""
    token_mask_high: float = Field(8.0, gt=0)
    """Mask a token whose trainer/inference probability ratio is above this (all loss types)."""
    geo_mask_low: float = Field(0.1, ge=0)
    """Mask a whole sequence whose geometric-mean trainer/inference ratio is below this."""
    geo_mask_high: float = Field(10.0, gt=0)
    """Mask a whole sequence whose geometric-mean trainer/inference ratio is above this."""
    sequence_mask_low: float = Field(0.0, ge=0)
    """Mask a whole sequence whose smallest token ratio is below this."""
    sequence_mask_high: float = Field(100.0, gt=0)
    """Mask a whole sequence whose largest token ratio is above this."""
    sequence_clip_high: float = Field(10.0, gt=0)
    """(aipo, `ratio_type: sequence`) Upper clip of the sequence-level importance ratio."""
    epsilon: float = Field(0.2, ge=0, lt=1)
    """(grpo/bnpo/dr_grpo/dapo) Lower clip: the ratio to the old policy is clipped to `[1 - epsilon, ...]`."""
    epsilon_high: float | None = Field(None, ge=0)
    """(grpo/bnpo/dr_grpo/dapo/luspo) Upper clip `1 + epsilon_high` (null: `epsilon`; DAPO recommends 0.28).
    (cispo) The cap of the detached ratio itself (ScaleRL's epsilon_max; 5.0 is recommended)."""
    sapo_temperature_pos: float = Field(1.0, gt=0)
    """(sapo) Gate temperature of tokens with a positive advantage."""
    sapo_temperature_neg: float = Field(1.05, gt=0)
    """(sapo) Gate temperature of tokens with a non-positive advantage."""
    vespo_k_pos: float = Field(2.0, ge=0)
    """(vespo) Gamma shape k of sequences with advantage >= 0: `phi(w) = exp(lambda) w^k exp(-lambda w)`."""
    vespo_lambda_pos: float = Field(3.0, ge=0)
    """(vespo) Gamma rate lambda of sequences with advantage >= 0 (floored at 1e-4, as TRL)."""
    vespo_k_neg: float = Field(3.0, ge=0)
    """(vespo) Gamma shape k of sequences with a negative advantage."""
    vespo_lambda_neg: float = Field(2.0, ge=0)
    """(vespo) Gamma rate lambda of sequences with a negative advantage (floored at 1e-4)."""
    delta: float | None = Field(None, gt=1)
    """(grpo/bnpo/dr_grpo/dapo) Two-sided clipping (INTELLECT-2): cap the unclipped ratio at `delta`; must
    exceed `1 + epsilon_high`. Null: off."""
    ratio_clip_c: float | None = Field(None, gt=1)
    """(grpo/bnpo/dr_grpo/dapo) Dual clip (NeMo RL): for negative advantages the objective is at least
    `ratio_clip_c * A`; must be > 1 (3 is usual). Null: off."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """(grpo/bnpo/dr_grpo/dapo) `token` ratios, or `sequence` (GSPO): exp of the mean token log-ratio of
    each sequence, with gradient through the mean."""
    num_iterations: int = Field(1, ge=1)
    """Optimizer steps per batch (mu). Iterations after the first reuse the batch against the old logprobs
    recorded in the first (all loss types). The LR schedule advances once per batch."""
    beta: float = Field(0.0, ge=0)
    """KL coefficient to the reference policy (k3 estimator). With LoRA the reference is the base model with
    the adapters disabled (one extra no-grad forward, no second copy). 0: no reference pass."""
    use_on_policy_kl_approximation: bool = False
    """(beta > 0) Weight the k3 KL of each token by the (detached) ratio current/old policy (NeMo RL); not with
    `use_bias_correction_kl`, which weights it by the same ratio (with its gradient)."""
    is_correction: Literal["none", "token", "truncated", "masked", "sequence_truncated",
                           "sequence_masked"] = "none"
    """(TRL loss types) Importance-sampling correction between trainer and inference policies
    (NeMo RL, TRL's `vllm_importance_sampling_mode`): multiply each token's objective by `w = exp(old - inference)`;
    `truncated` clamps w to [`is_cap_min`, `is_cap`]; `masked` drops tokens whose w is outside it. The
    `sequence_*` modes use one weight per sequence, `exp(sum_i(old - inference))`, truncated or masked the same
    way. `none`: off (`aipo` always weights by this ratio). `vespo` folds the weight into its sequence ratio."""
    is_cap: float = Field(2.0, gt=0)
    """Upper bound of the truncated / masked importance-sampling correction (`.inf`: none, with `is_cap_min`)."""
    is_cap_min: float | None = Field(None, ge=0)
    """Lower bound of the truncated / masked importance-sampling correction (TRL's
    `vllm_importance_sampling_clip_min`); null: none."""
    off_policy_mask_threshold: float | None = Field(None, ge=0)
    """(TRL loss types) DeepSeek-V3.2's off-policy sequence mask: a sequence with a negative advantage whose mean
    `inference - lp` (a KL estimate) exceeds this leaves the policy term. Null: off."""
    use_bias_correction_kl: bool = False
    """(TRL loss types, beta > 0) Multiply the k3 KL of each token by the ratio to the old policy `r` (with its
    gradient; the sequence ratio with `importance_sampling_level: sequence`), DeepSeek-V3.2's unbiased KL."""
    top_entropy_quantile: float = Field(1.0, ge=0, le=1)
    """Keep in the policy term only the top-rho fraction of tokens by entropy (over each micro-batch's loss
    tokens); 1 keeps all, 0 only the highest-entropy token."""
    entropy_coef: float = 0.0
    """Entropy bonus (TRL 1.16's `entropy_coef`): the loss minus `entropy_coef` x the mean entropy of the policy
    term's tokens in each micro-batch (over the optimizer step's micro-batches, not rescaled by `loss_type`). The
    entropy needs its gradient, so the trainer takes the full-logits path (logprob_chunk_size has no effect; the
    (B, T, V) logits are held). 0: off."""
    use_adaptive_entropy: bool = False
    """TRL 1.16's adaptive entropy coefficient (`tidal.trainer.step.entropy_control`): starts at `entropy_coef`,
    moves by `entropy_coef_delta` after every optimizer step toward `entropy_target`, applied only while the
    entropy is at or below the target. Checkpointed with the trainer state (a resumed run continues it)."""
    entropy_coef_min: float = 0.0
    """(use_adaptive_entropy) Lowest coefficient."""
    entropy_coef_max: float = 1.0
    """(use_adaptive_entropy) Highest coefficient."""
    entropy_coef_delta: float = Field(0.005, ge=0)
    """(use_adaptive_entropy) Step of the coefficient per optimizer step."""
    entropy_target: float = 0.2
    """(use_adaptive_entropy) Entropy (nats per token) below which the coefficient grows and is applied."""
    sync_ref_model: bool = False
    """(beta > 0, full fine-tuning, one rank) TR-DPO's reference updates (TRL's `sync_ref_model`): after every
    `ref_model_sync_steps`-th optimizer step of the run, reference <- alpha x policy + (1 - alpha) x reference,
    every weight (`tidal.trainer.step.ref_sync`); the reference is checkpointed with the trainer state."""
    ref_model_mixup_alpha: float = Field(0.6, ge=0, le=1)
    """(sync_ref_model) alpha, the policy's share of the mixed reference."""
    ref_model_sync_steps: int = Field(512, ge=1)
    """(sync_ref_model) Optimizer steps between reference updates."""
    mask_truncated_completions: bool = False
    """Exclude completions that hit `max_tokens` (finish reason `length`) from the loss."""

    @model_validator(mode="after")
    def _consistent(self) -> LossConfig:
        for low, high in (("token_mask_low", "token_mask_high"), ("geo_mask_low", "geo_mask_high"),
                          ("sequence_mask_low", "sequence_mask_high")):
            if getattr(self, low) >= getattr(self, high):
                raise ValueError(f"loss.{low} ({getattr(self, low)}) must be below loss.{high} "
                                 f"({getattr(self, high)})")
        def changed(key: str) -> bool:  # by value, so a dumped resolved config validates like the original
            return bool(getattr(self, key) != LossConfig.model_fields[key].default)

        if self.loss_type == "aipo":
            wrong = [k for k in CLIPPED_ONLY if changed(k)]
            if wrong:
                raise ValueError(f"loss.{wrong[0]} applies to TRL's loss types ({', '.join(TRL_TYPES)}), "
                                 f"not to loss_type 'aipo', which weights every token by the trainer/inference "
                                 f"ratio instead of clipping; set loss.loss_type or remove loss.{wrong[0]}")
        else:
            wrong = [k for k in AIPO_ONLY if changed(k)]
            if wrong:
                alt: dict[str, str] = {"kl_tau": " (for a KL penalty use loss.beta)",
                       "ratio_type": " (for sequence-level ratios use loss.importance_sampling_level)"}
                raise ValueError(f"loss.{wrong[0]} applies to loss_type 'aipo' only, not '{self.loss_type}'"
                                 f"{alt.get(wrong[0], '')}")
            eps_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
            wrong = [k for k in ("delta", "ratio_clip_c") if changed(k) and self.loss_type not in CLIPPED_TYPES]
            if wrong:
                raise ValueError(f"loss.{wrong[0]} applies to the clipped loss types ({', '.join(CLIPPED_TYPES)}), "
                                 f"not '{self.loss_type}', which does not clip the ratio that way")
            if self.delta is not None and self.delta <= 1 + eps_high:
                raise ValueError(f"loss.delta ({self.delta}) must exceed 1 + epsilon_high ({1 + eps_high}); otherwise "
                                 f"it clips inside the trust region")
            if self.importance_sampling_level == "sequence" and self.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
                warnings.warn(f"loss.importance_sampling_level 'sequence' with loss_type '{self.loss_type}': "
                              f"the sequence ratio is applied to every token and then normalized by token "
                              f"counts, so long sequences weigh more; GSPO normalizes per sequence "
                              f"(loss_type 'grpo')", ConfigWarning, stacklevel=2)
        for key in ("is_cap", "is_cap_min"):
            if changed(key) and self.is_correction in ("none", "token"):
                raise ValueError(f"loss.{key} only applies with loss.is_correction 'truncated', 'masked', "
                                 f"'sequence_truncated' or 'sequence_masked'")
        if self.is_cap_min is not None and self.is_cap_min >= self.is_cap:
            raise ValueError(f"loss.is_cap_min ({self.is_cap_min}) must be below loss.is_cap ({self.is_cap})")
        for typ, keys in TYPE_KEYS.items():
            wrong = [k for k in keys if changed(k) and self.loss_type != typ]
            if wrong:
                raise ValueError(f"loss.{wrong[0]} applies to loss_type '{typ}' only, not '{self.loss_type}'")
        if self.loss_type == "vespo" and self.is_correction.startswith("sequence"):
            raise ValueError(f"loss.is_correction '{self.is_correction}' with loss_type 'vespo': vespo folds a "
                             f"token-level correction into its sequence weight; use 'truncated' or 'masked' (as TRL)")
        wrong = [k for k in ("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target")
                 if changed(k) and not self.use_adaptive_entropy]
        if wrong:
            raise ValueError(f"loss.{wrong[0]} applies with loss.use_adaptive_entropy: true only")
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(f"loss.entropy_coef_min ({self.entropy_coef_min}) must not exceed loss.entropy_coef_max "
                             f"({self.entropy_coef_max})")
        if self.use_bias_correction_kl and self.beta == 0:
            raise ValueError("loss.use_bias_correction_kl needs loss.beta > 0 (there is no KL term)")
        if self.use_on_policy_kl_approximation and self.beta == 0:
            raise ValueError("loss.use_on_policy_kl_approximation needs loss.beta > 0 (there is no KL term)")
        if self.use_on_policy_kl_approximation and self.use_bias_correction_kl:
            raise ValueError("loss.use_on_policy_kl_approximation and loss.use_bias_correction_kl both weight the KL "
                             "term by the ratio to the old policy exp(lp - old) (NeMo RL's detached, TRL 1.16's with "
                             "its gradient): together the KL would be weighted twice; set one of them")
        return self

    @model_validator(mode="after")
    def _ref_sync(self) -> LossConfig:
        if self.sync_ref_model and self.beta == 0:
            raise ValueError("loss.sync_ref_model needs loss.beta > 0: without a KL term there is no reference model "
                             "to update (as in TRL)")
        wrong = [k for k in ("ref_model_mixup_alpha", "ref_model_sync_steps")
                 if getattr(self, k) != LossConfig.model_fields[k].default and not self.sync_ref_model]
        if wrong:
            raise ValueError(f"loss.{wrong[0]} applies with loss.sync_ref_model: true only")
        return self
