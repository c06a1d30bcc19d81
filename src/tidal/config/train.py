"""Trainer config (`train.yaml`): the seed's SFT-inherited keys plus the GRPO `loss` section.

Precision: on CPU the trainer always computes in float32 (vLLM CPU serves the bundled model in float32 too,
so trainer and inference logprobs agree to ~1e-6); on GPU `recipe: bf16` trains in bfloat16, and the fp8 and
nvfp4 recipes fall back to bfloat16 with a warning until they are implemented.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from tidal.config.base import StrictModel

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LossConfig(StrictModel):
    """GRPO loss of seed 000: `coeff = ratio * (adv_tau * A - kl_tau * log_ratio)`, detached, with masks."""

    UNSUPPORTED = frozenset({"teacher_tau", "sequence_clip_high"})

    ratio_type: Literal["token"] = "token"
    """Importance-ratio granularity. Only `token` (per-token ratio) is implemented so far."""
    kl_tau: float = Field(0.0, ge=0)
    """KL penalty coefficient on `log_ratio` (trainer vs inference policy)."""
    adv_tau: float = Field(1.0, ge=0)
    """Advantage scaling factor."""
    teacher_tau: float = 0.0
    """Teacher KL distillation coefficient (not supported yet)."""
    token_mask_low: float = Field(0.125, ge=0)
    """Mask a token whose importance ratio is below this."""
    token_mask_high: float = Field(8.0, gt=0)
    """Mask a token whose importance ratio is above this."""
    geo_mask_low: float = Field(0.1, ge=0)
    """Mask a whole sequence whose geometric-mean token ratio is below this."""
    geo_mask_high: float = Field(10.0, gt=0)
    """Mask a whole sequence whose geometric-mean token ratio is above this."""
    sequence_mask_low: float = Field(0.0, ge=0)
    """Mask a whole sequence whose smallest token ratio is below this."""
    sequence_mask_high: float = Field(100.0, gt=0)
    """Mask a whole sequence whose largest token ratio is above this."""
    sequence_clip_high: float = 10.0
    """Clip of the sequence-level ratio (used with `ratio_type: sequence`; not supported yet)."""

    @model_validator(mode="after")
    def _bounds_ordered(self) -> LossConfig:
        for low, high in (("token_mask_low", "token_mask_high"), ("geo_mask_low", "geo_mask_high"),
                          ("sequence_mask_low", "sequence_mask_high")):
            if getattr(self, low) >= getattr(self, high):
                raise ValueError(f"loss.{low} ({getattr(self, low)}) must be below loss.{high} "
                                 f"({getattr(self, high)})")
        return self


class NoiseSchedulerConfig(StrictModel):
    """QeRL noisy RMSNorm weights during rollouts (not supported yet)."""

    UNSUPPORTED = frozenset({"enabled"})

    enabled: bool = False
    """Enable QeRL noise injection (not supported yet)."""
    sigma_start: float = 5e-2
    """Initial noise standard deviation."""
    sigma_end: float = 5e-4
    """Final noise standard deviation."""
    num_stages: int = Field(10, ge=1)
    """Number of geometric decay intervals."""


class SftSection(StrictModel):
    """`tidal sft`: supervised warm start on an environment's reference completions."""

    env: str = "reverse-text"
    """Environment id whose `reference_completion`s are the targets."""
    env_args: dict[str, Any] = Field(default_factory=dict)
    """Arguments of that environment."""
    examples_per_step: int = Field(32, ge=1)
    """Examples per optimizer step."""
    save_to: str | None = None
    """Where to save the result (null: `{output_dir}/sft`). Full weights when `lora: false`, else the adapter."""
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    """Label smoothing of the SFT targets: loss = (1 - e) * NLL + e * mean over the vocabulary of -log p."""
    save_every: int | None = Field(None, ge=1)
    """Also save a snapshot to `{save_to}/step_{n}` every N steps (null: only the final result)."""


class TrainConfig(StrictModel):
    """Everything `tidal grpo-train` and `tidal sft` read from `train.yaml`."""

    UNSUPPORTED = frozenset({"gradient_accumulation_steps", "qlora_fp8", "qlora_bnb", "qlora_fp4",
                             "zero_level", "transport_type"})

    model: str
    """Local Hugging Face model directory to train, or `tidal:tiny-reverse` (the bundled model)."""
    output_dir: str = "outputs"
    """Run directory shared with the orchestrator, or a parent holding exactly one `run_*` run directory."""
    gpus: int = Field(1, ge=1, le=1)
    """Number of GPUs. Only 1 is supported so far."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: `auto` picks CUDA when available, else CPU."""
    per_device_train_batch_size: int = Field(2, ge=1)
    """Packed rows of `sequence_len` tokens per micro-batch (forward/backward pass)."""
    sequence_len: int = Field(1024, ge=16)
    """Length of one packed row; samples are packed into rows with no attention across samples."""
    max_steps: int = Field(-1, ge=-1)
    """Training steps; -1 runs until the orchestrator says it is done."""
    logging_steps: int = Field(1, ge=1)
    """Print a progress line every N steps (metrics.jsonl gets every step)."""
    gradient_accumulation_steps: int = 4
    """Not supported yet: one trainer step always consumes exactly one orchestrator batch."""
    learning_rate: float = Field(2e-4, gt=0)
    """Peak learning rate."""
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warmup."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps from 0 to `learning_rate`."""
    max_grad_norm: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this (0 disables clipping)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW beta1."""
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    """AdamW beta2."""
    optimizer: Literal["adamw", "adamw_torch", "adamw_8bit"] = "adamw"
    """Optimizer. `adamw`/`adamw_torch` are torch's AdamW; `adamw_8bit` falls back to it with a warning."""
    recipe: Literal["bf16", "fp32", "fp8-hybrid", "fp8_hybrid", "nvfp4"] = "bf16"
    """Precision recipe on GPU (CPU always uses float32, see module doc)."""
    lora: bool = True
    """Train LoRA adapters (PEFT). `false` trains all weights: supported by `tidal sft` only so far."""
    lora_rank: int = Field(16, ge=1)
    """LoRA rank r."""
    lora_alpha: int = Field(32, gt=0)
    """LoRA alpha (scale = alpha / r)."""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """LoRA dropout."""
    lora_target_modules: list[str] = Field(default_factory=lambda: list(ALL_LINEAR))
    """Module names that get LoRA adapters."""
    qlora_fp8: bool = False
    """FP8 QLoRA (not supported yet)."""
    qlora_bnb: bool = False
    """NF4 QLoRA (not supported yet)."""
    qlora_fp4: bool = False
    """FP4 QLoRA (not supported yet)."""
    zero_level: int = 1
    """Optimizer-state sharding level (multi-GPU; not supported yet)."""
    max_async_level: int = Field(1, ge=0)
    """Policy lag allowed to inference; the trainer keeps the newest `max_async_level + 1` broadcasts."""
    transport_type: Literal["filesystem", "zmq"] = "filesystem"
    """How batches arrive from the orchestrator (only `filesystem` so far)."""
    seed: int = 42
    """Seed for torch's RNG (LoRA init, dropout)."""
    cpu_affinity: list[int] | None = None
    """CPU cores the trainer may run on (Linux; torch uses one thread per core). Null: all cores, except that
    `tidal grpo` on a CPU-only machine gives the trainer the second half of the cores and vLLM the first."""
    batch_timeout_s: float = Field(1800.0, gt=0)
    """Give up (exit 1) when the next batch has not arrived within this many seconds."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """GRPO loss settings."""
    noise_scheduler: NoiseSchedulerConfig = Field(default_factory=NoiseSchedulerConfig)
    """QeRL noise schedule (not supported yet)."""
    sft: SftSection = Field(default_factory=SftSection)
    """Settings used only by `tidal sft`."""
