"""TRL 1.16 `GRPOConfig`'s algorithm keys: the loss, its importance-sampling corrections and masks, and the
optimizer / model keys TRL inherits from transformers' `TrainingArguments` that shape the algorithm (issue 51).

`TRLAlgorithmKeys` is the part of `tidal.api.grpo_config.GRPOConfig` these keys live in (its base class), at TRL 1.16's
defaults, so a script that sets nothing runs TRL's algorithm: `dapo` and, with `beta` > 0, the bias-corrected KL;
with `use_vllm=True` also the vLLM importance-sampling correction in `sequence_mask` mode (clip 3.0). TRL applies
that correction (and checks its mode against `vespo`) only with `use_vllm`, because without vLLM it samples with
the trained model itself; tidal always samples with vLLM, so `use_vllm=True` is the setting that corrects for the
trainer/vLLM mismatch (docs/trl.md), and `use_vllm=False` runs what TRL runs: no correction, sampled on-policy
(`tidal.api.grpo_config.to_tidal` sets `max_async_level` 0 whenever nothing corrects). `loss_keys(args)`
gives the train `loss` section (`tidal.config.loss.LossConfig`) and `algorithm_train_keys(args)` the other train
keys; `ALGORITHM_MAPPING` says where each key goes (docs/trl.md). Seed 000's trainer/inference masks, which TRL
does not have, are off in the derived `loss` (`NO_SEED_MASKS`). Keys tidal cannot honor are refused with the
reason (`ALGORITHM_UNSUPPORTED`: accepted at TRL's default only). Torch-free, pure.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, model_validator

from tidal.config.base import StrictModel

NO_SEED_MASKS: dict[str, float] = {"token_mask_low": 0.0, "token_mask_high": math.inf, "geo_mask_low": 0.0,
                                   "geo_mask_high": math.inf, "sequence_mask_low": 0.0,
                                   "sequence_mask_high": math.inf}
"""Seed 000's masks on the trainer/inference ratio, off: TRL has none (its IS correction is `vllm_importance_*`)."""

IS_MODES = {"token_truncate": "truncated", "token_mask": "masked", "sequence_truncate": "sequence_truncated",
            "sequence_mask": "sequence_masked"}
"""TRL's `vllm_importance_sampling_mode` -> train `loss.is_correction`."""

IS_KEYS = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
           "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap")
"""The keys of TRL's vLLM importance-sampling correction: read with `use_vllm=True` only (else refused when set)."""

ALGORITHM_UNSUPPORTED = frozenset({
    "cast_lm_head_to_fp32", "per_device_eval_batch_size",
    "eval_on_start"})
"""Algorithm keys accepted at TRL's default only (docs/trl.md says why for each)."""


class TRLAlgorithmKeys(StrictModel):
    """The loss and optimizer keys of TRL 1.16's `GRPOConfig` (TRL's defaults), base of `GRPOConfig`."""

    beta: float = Field(0.0, ge=0)
    """KL coefficient to the reference model (train `loss.beta`)."""
    epsilon: float = Field(0.2, ge=0, lt=1)
    """Lower clip (train `loss.epsilon`)."""
    epsilon_high: float | None = Field(None, ge=0)
    """Upper clip, None: `epsilon` (train `loss.epsilon_high`); with `cispo` the cap of the ratio itself (5.0 is
    ScaleRL's recommendation)."""
    delta: float | None = Field(None, gt=1)
    """Two-sided clipping of the clipped loss types (train `loss.delta`)."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"] = "dapo"
    """The objective and its normalization (train `loss.loss_type`; docs/algorithms.md)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """Token ratios or GSPO's sequence ratios (train `loss.importance_sampling_level`)."""
    num_iterations: int = Field(1, ge=1)
    """Optimizer passes per generation, mu (train `loss.num_iterations`)."""
    mask_truncated_completions: bool = False
    """Truncated completions leave the loss (train `loss.mask_truncated_completions`)."""
    top_entropy_quantile: float = Field(1.0, ge=0, le=1)
    """Policy loss only on the highest-entropy tokens (train `loss.top_entropy_quantile`)."""
    sapo_temperature_neg: float = Field(1.05, gt=0)
    """(sapo) Gate temperature of tokens with a non-positive advantage (train `loss.sapo_temperature_neg`)."""
    sapo_temperature_pos: float = Field(1.0, gt=0)
    """(sapo) Gate temperature of tokens with a positive advantage (train `loss.sapo_temperature_pos`)."""
    vespo_k_pos: float = Field(2.0, ge=0)
    """(vespo) Gamma shape for advantages >= 0 (train `loss.vespo_k_pos`)."""
    vespo_lambda_pos: float = Field(3.0, ge=0)
    """(vespo) Gamma rate for advantages >= 0 (train `loss.vespo_lambda_pos`)."""
    vespo_k_neg: float = Field(3.0, ge=0)
    """(vespo) Gamma shape for negative advantages (train `loss.vespo_k_neg`)."""
    vespo_lambda_neg: float = Field(2.0, ge=0)
    """(vespo) Gamma rate for negative advantages (train `loss.vespo_lambda_neg`)."""
    use_vllm: bool = False
    """TRL: generate with vLLM. tidal always generates with vLLM; as in TRL the value decides whether the
    `vllm_importance_sampling_*` correction applies (True: yes, the setting for tidal's vLLM samples; False, TRL's
    default: TRL samples with the trained model and corrects nothing, and neither does tidal, which then samples
    on-policy, orch and train `max_async_level` 0)."""
    vllm_importance_sampling_correction: bool = True
    """(use_vllm) Correct for the trainer/vLLM mismatch with importance weights (train `loss.is_correction`;
    `none` if False or without `use_vllm`, as in TRL)."""
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate",
                                           "sequence_mask"] = "sequence_mask"
    """Per token or per sequence (exp of the summed log ratio), truncated or masked (train `loss.is_correction`:
    `truncated`, `masked`, `sequence_truncated`, `sequence_masked`)."""
    vllm_importance_sampling_clip_max: float | None = Field(3.0, gt=0)
    """Upper bound of the importance weight (train `loss.is_cap`; None: none)."""
    vllm_importance_sampling_clip_min: float | None = Field(None, ge=0)
    """Lower bound of the importance weight (train `loss.is_cap_min`; None: none)."""
    vllm_importance_sampling_cap: float | None = Field(None, gt=0)
    """Deprecated in TRL: `vllm_importance_sampling_clip_max` (wins when set)."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss minus this x the mean token entropy (train `loss.entropy_coef`)."""
    use_adaptive_entropy: bool = False
    """Adapt `entropy_coef` every optimizer step toward `entropy_target` (train `loss.use_adaptive_entropy`)."""
    entropy_coef_min: float = 0.0
    """(use_adaptive_entropy) Lowest coefficient (train `loss.entropy_coef_min`)."""
    entropy_coef_max: float = 1.0
    """(use_adaptive_entropy) Highest coefficient (train `loss.entropy_coef_max`)."""
    entropy_coef_delta: float = Field(0.005, ge=0)
    """(use_adaptive_entropy) Step per optimizer step (train `loss.entropy_coef_delta`)."""
    entropy_target: float = 0.2
    """(use_adaptive_entropy) Target entropy (train `loss.entropy_target`)."""
    off_policy_mask_threshold: float | None = Field(None, ge=0)
    """DeepSeek-V3.2's off-policy sequence mask threshold (train `loss.off_policy_mask_threshold`)."""
    use_bias_correction_kl: bool = True
    """Multiply the KL term by the ratio to the old policy (train `loss.use_bias_correction_kl` when beta > 0;
    without a KL term it has nothing to act on, in TRL too)."""
    # inherited from TrainingArguments: the optimizer and the model's kernels
    adam_epsilon: float = Field(1e-8, gt=0)
    """AdamW epsilon (train `adam_epsilon`)."""
    torch_compile: bool = False
    """Compile the model (train `compile_layers`: tidal compiles each decoder layer)."""
    use_liger_kernel: bool = False
    """Liger's kernels (train `liger_kernel: [rms_norm, swiglu, rope]`; TRL's fused Liger GRPO loss is not used:
    tidal's loss is its own, chunked over the vocabulary)."""
    disable_dropout: bool = False
    """Every dropout module of the policy at p = 0 (train `disable_dropout`)."""
    gradient_checkpointing_kwargs: dict[str, Any] | None = None
    """Only `{"use_reentrant": False}` (what tidal's checkpointing is) or None."""
    lr_scheduler_kwargs: dict[str, Any] | None = None
    """Arguments of the schedule: `{"num_cycles": x}` with `lr_scheduler_type='cosine'` (train
    `lr_cosine_cycles`); tidal's linear and constant schedules have no knob, so any other key is refused."""
    sync_ref_model: bool = False
    """TR-DPO's reference updates (train `loss.sync_ref_model`): needs `beta` > 0 and full fine-tuning (no
    `peft_config`: mixing a LoRA adapter's A and B separately does not mix their product; TRL refuses PEFT too)."""
    ref_model_mixup_alpha: float = Field(0.6, ge=0, le=1)
    """(sync_ref_model) The policy's share of the mixed reference (train `loss.ref_model_mixup_alpha`)."""
    ref_model_sync_steps: int = Field(512, ge=1)
    """(sync_ref_model) Optimizer steps between reference updates (train `loss.ref_model_sync_steps`)."""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """Several reward functions: sum the weighted rewards, then normalize (default), or GDPO's per-function
    normalization first (orch `advantage.multi_objective_aggregation`; `normalize_then_sum` ignores
    `scale_rewards`, as in TRL)."""
    # accepted at TRL's default only (ALGORITHM_UNSUPPORTED)
    cast_lm_head_to_fp32: bool = False
    """Not supported yet."""
    per_device_eval_batch_size: int = 8
    """Not supported: tidal's evaluation generates the eval set in one pass (orch `eval`), no batch size."""
    eval_on_start: bool = False
    """Not supported yet."""

    @model_validator(mode="after")
    def _trl_checks(self) -> TRLAlgorithmKeys:
        if self.gradient_checkpointing_kwargs not in (None, {}, {"use_reentrant": False}):
            raise ValueError(f"GRPOConfig gradient_checkpointing_kwargs {self.gradient_checkpointing_kwargs} is not "
                             f"supported: tidal's checkpointing is non-reentrant ({{'use_reentrant': False}})")
        if self.sync_ref_model and self.beta == 0:
            raise ValueError("GRPOConfig sync_ref_model=True needs beta > 0: without a KL term there is no reference "
                             "model to synchronize (as in TRL)")
        for key in ("ref_model_mixup_alpha", "ref_model_sync_steps"):
            if not self.sync_ref_model and getattr(self, key) != type(self).model_fields[key].default:
                raise ValueError(f"GRPOConfig {key} applies with sync_ref_model=True only")
        if not self.use_vllm:  # TRL reads these with vLLM only: without it nothing is corrected (on-policy)
            given = [k for k in IS_KEYS if k in self.model_fields_set
                     and getattr(self, k) != type(self).model_fields[k].default]
            if given:
                raise ValueError(f"GRPOConfig {given[0]} applies with use_vllm=True only (as in TRL, the vLLM "
                                 f"importance-sampling correction is off without it, and tidal then samples "
                                 f"on-policy); set use_vllm=True or leave {given[0]} at its default")
        lo, hi = self.vllm_importance_sampling_clip_min, self.is_cap()
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"GRPOConfig vllm_importance_sampling_clip_min ({lo}) must be less than "
                             f"vllm_importance_sampling_clip_max ({hi})")
        if not self.vllm_importance_sampling_correction:
            return self
        if self.vllm_importance_sampling_mode.endswith("truncate") and lo is None and hi is None:
            raise ValueError("GRPOConfig: set vllm_importance_sampling_clip_min or vllm_importance_sampling_clip_max "
                             "with a *_truncate vllm_importance_sampling_mode")
        if (self.use_vllm and self.loss_type == "vespo"
                and self.vllm_importance_sampling_mode.startswith("sequence")):  # TRL checks it with vLLM only
            raise ValueError(f"GRPOConfig loss_type 'vespo' with use_vllm=True needs vllm_importance_sampling_mode "
                             f"token_truncate or token_mask, not '{self.vllm_importance_sampling_mode}' (as in TRL), "
                             f"or vllm_importance_sampling_correction=False")
        return self

    def corrects_is(self) -> bool:
        """Whether TRL applies its vLLM importance-sampling correction: with `use_vllm` only."""
        return self.use_vllm and self.vllm_importance_sampling_correction

    def is_cap(self) -> float | None:
        """The upper IS bound (`vllm_importance_sampling_cap` wins over `..._clip_max`, as in TRL)."""
        return self.vllm_importance_sampling_cap or self.vllm_importance_sampling_clip_max


def loss_keys(args: TRLAlgorithmKeys) -> dict[str, Any]:
    """The train `loss` section that runs `args`' objective as TRL 1.16 does."""
    loss: dict[str, Any] = {
        "loss_type": args.loss_type, "beta": args.beta, "epsilon": args.epsilon, "epsilon_high": args.epsilon_high,
        "delta": args.delta, "importance_sampling_level": args.importance_sampling_level,
        "num_iterations": args.num_iterations, "mask_truncated_completions": args.mask_truncated_completions,
        "top_entropy_quantile": args.top_entropy_quantile, "entropy_coef": args.entropy_coef,
        "use_adaptive_entropy": args.use_adaptive_entropy,
        "off_policy_mask_threshold": args.off_policy_mask_threshold,
        "use_bias_correction_kl": args.use_bias_correction_kl and args.beta > 0, **NO_SEED_MASKS}
    if args.sync_ref_model:
        loss |= {"sync_ref_model": True, "ref_model_mixup_alpha": args.ref_model_mixup_alpha,
                 "ref_model_sync_steps": args.ref_model_sync_steps}
    if args.use_adaptive_entropy:
        loss |= {k: getattr(args, k) for k in ("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta",
                                               "entropy_target")}
    if args.loss_type == "sapo":
        loss |= {"sapo_temperature_pos": args.sapo_temperature_pos, "sapo_temperature_neg": args.sapo_temperature_neg}
    if args.loss_type == "vespo":
        loss |= {"vespo_k_pos": args.vespo_k_pos, "vespo_lambda_pos": args.vespo_lambda_pos,
                 "vespo_k_neg": args.vespo_k_neg, "vespo_lambda_neg": args.vespo_lambda_neg}
    if args.corrects_is():
        cap = args.is_cap()
        loss |= {"is_correction": IS_MODES[args.vllm_importance_sampling_mode],
                 "is_cap": math.inf if cap is None else cap, "is_cap_min": args.vllm_importance_sampling_clip_min}
    return loss


def algorithm_train_keys(args: TRLAlgorithmKeys) -> dict[str, Any]:
    """The train keys (outside `loss`) of the inherited optimizer / kernel keys."""
    out: dict[str, Any] = {"loss": loss_keys(args), "adam_epsilon": args.adam_epsilon,
                           "disable_dropout": args.disable_dropout}
    if args.torch_compile:
        out["compile_layers"] = True
    if args.use_liger_kernel:
        out["liger_kernel"] = ["rms_norm", "swiglu", "rope"]
    return out


ALGORITHM_MAPPING: dict[str, str] = {
    "beta": "train `loss.beta`", "epsilon": "train `loss.epsilon`", "epsilon_high": "train `loss.epsilon_high`",
    "delta": "train `loss.delta`", "loss_type": "train `loss.loss_type`",
    "importance_sampling_level": "train `loss.importance_sampling_level`",
    "num_iterations": "train `loss.num_iterations`",
    "mask_truncated_completions": "train `loss.mask_truncated_completions`",
    "top_entropy_quantile": "train `loss.top_entropy_quantile`",
    "sapo_temperature_neg": "train `loss.sapo_temperature_neg`",
    "sapo_temperature_pos": "train `loss.sapo_temperature_pos`", "vespo_k_pos": "train `loss.vespo_k_pos`",
    "vespo_lambda_pos": "train `loss.vespo_lambda_pos`", "vespo_k_neg": "train `loss.vespo_k_neg`",
    "vespo_lambda_neg": "train `loss.vespo_lambda_neg`",
    "use_vllm": "train `loss.is_correction` (`none` when False, as TRL; tidal always samples with vLLM, then "
                "on-policy: orch/train `max_async_level` 0)",
    "vllm_importance_sampling_correction": "train `loss.is_correction` (`none` when False or without use_vllm)",
    "vllm_importance_sampling_mode": "train `loss.is_correction`: `truncated`, `masked`, `sequence_truncated`, "
                                     "`sequence_masked`",
    "vllm_importance_sampling_clip_max": "train `loss.is_cap` (None: `.inf`)",
    "vllm_importance_sampling_clip_min": "train `loss.is_cap_min`",
    "vllm_importance_sampling_cap": "train `loss.is_cap`",
    "off_policy_mask_threshold": "train `loss.off_policy_mask_threshold`",
    "entropy_coef": "train `loss.entropy_coef`", "use_adaptive_entropy": "train `loss.use_adaptive_entropy`",
    "entropy_coef_min": "train `loss.entropy_coef_min`", "entropy_coef_max": "train `loss.entropy_coef_max`",
    "entropy_coef_delta": "train `loss.entropy_coef_delta`", "entropy_target": "train `loss.entropy_target`",
    "use_bias_correction_kl": "train `loss.use_bias_correction_kl` (with beta > 0)",
    "adam_epsilon": "train `adam_epsilon`", "disable_dropout": "train `disable_dropout`",
    "torch_compile": "train `compile_layers`",
    "use_liger_kernel": "train `liger_kernel` (rms_norm, swiglu, rope)",
    "lr_scheduler_kwargs": "train `lr_cosine_cycles` (`num_cycles`, with `lr_scheduler_type='cosine'`)",
    "sync_ref_model": "train `loss.sync_ref_model` (beta > 0, full fine-tuning)",
    "ref_model_mixup_alpha": "train `loss.ref_model_mixup_alpha`",
    "ref_model_sync_steps": "train `loss.ref_model_sync_steps`",
    "multi_objective_aggregation": "orch `advantage.multi_objective_aggregation`",
    "gradient_checkpointing_kwargs": "(tidal's checkpointing is non-reentrant: None or `{'use_reentrant': False}`)",
}
"""Algorithm key -> where it goes in tidal (docs/trl.md)."""
