"""`GRPOConfig`: TRL's GRPOConfig key names, mapped onto tidal's train / infer / orch configs.

A TRL user's `GRPOConfig(...)` is accepted as written where tidal implements the key (`MAPPING` says where each
goes; docs/trl.md has the table). A TRL key tidal does not implement is accepted only at TRL's default value;
any other value is an error naming the key (`UNSUPPORTED`, `REFUSED`), and a key TRL does not have either is an
error naming the nearest valid one: nothing is ignored.

Units. TRL counts optimizer steps; tidal counts rollout batches (one trainer step per batch, which may hold
several optimizer steps). One TRL generation batch is `per_device_train_batch_size x steps_per_generation`
completions (= orch `batch_size`, world size 1), trained in `steps_per_generation / gradient_accumulation_steps`
optimizer steps (train `steps_per_generation`), each repeated `num_iterations` times. So `max_steps`,
`save_steps`, `logging_steps`, `eval_steps` and the warmup (`warmup_steps`, or `warmup_ratio` x the run's
optimizer steps) become batches: `ceil(n / optimizer steps per batch)`.

Lag. TRL samples with the policy it trains; tidal samples with vLLM, one policy behind by default on a GPU
(`tidal.colocate.derive`). A lag needs the importance-sampling correction, so without it (`use_vllm=False`, TRL's
default, or `vllm_importance_sampling_correction=False`) orch and train `max_async_level` are 0: on-policy, as TRL.

`to_tidal(args, model, ...)` is pure and torch-free: it returns the three validated configs.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from tidal.api.loss_keys import ALGORITHM_MAPPING, ALGORITHM_UNSUPPORTED, TRLAlgorithmKeys, algorithm_train_keys
from tidal.api.training_args import REMOVED, TrainingArgumentsFields
from tidal.config.infer import InferConfig
from tidal.config.orch import OrchConfig
from tidal.config.train import TrainConfig


class GRPOConfig(TRLAlgorithmKeys, TrainingArgumentsFields):
    """TRL's `GRPOConfig`, the keys tidal implements (TRL's defaults unless noted) and those it refuses; the loss,
    importance-sampling and optimizer keys come from `TRLAlgorithmKeys`, the other fields TRL inherits from
    transformers' TrainingArguments from `TrainingArgumentsFields`."""

    REFUSED: ClassVar[dict[str, str]] = {
        "resume_from_checkpoint": "is not read by the trainer (in transformers neither): pass it to "
                                  "trainer.train(resume_from_checkpoint=...)"}
    UNSUPPORTED: ClassVar[frozenset[str]] = frozenset({
        "fp16", "push_to_hub", "hub_model_id", "model_init_kwargs", "vllm_enable_sleep_mode", "generation_kwargs",
        "load_best_model_at_end", "num_completions_to_print", "wandb_log_unique_prompts", "vllm_server_base_url",
        "shuffle_dataset", "remove_unused_columns", "use_transformers_paged", "vllm_structured_outputs_regex",
        "router_aux_loss_coef", "ds3_gather_for_generation", "pad_to_multiple_of", "cache_implementation",
        "vllm_model_impl", "vllm_group_port", "log_multimodal", "log_unique_prompts", "log_completions_hub_repo",
        "use_transformers_continuous_batching", "transformers_continuous_batching_config"}) | ALGORITHM_UNSUPPORTED

    output_dir: str = "trainer_output"
    """Run directory (orch `output_dir`; the trainer shares it)."""
    # generation
    num_generations: int = Field(8, ge=1)
    """Completions per prompt (orch `rollouts_per_example`)."""
    max_completion_length: int = Field(512, ge=1)
    """Max completion tokens (orch `sampling.max_tokens`)."""
    max_prompt_length: int | None = Field(512, ge=1)
    """(older TRL versions; newer ones do not truncate) Longer prompts keep their last tokens (orch `seq_len` = this +
    `max_completion_length`, `long_prompts: truncate`). None: no truncation; then `vllm_max_model_length`
    bounds prompt + completion (longer prompts are skipped)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (orch `sampling.temperature`)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling (orch `sampling.top_p`)."""
    top_k: int | None = 0
    """Top-k sampling, 0 or None: off (orch `sampling.top_k`)."""
    min_p: float | None = None
    """Min-p sampling, None: off (orch `sampling.min_p`)."""
    repetition_penalty: float = Field(1.0, gt=0)
    """vLLM's repetition penalty (orch `sampling.repetition_penalty`)."""
    generation_batch_size: int | None = Field(None, ge=1)
    """Completions per generation (orch `batch_size`); set this or `steps_per_generation`."""
    steps_per_generation: int | None = Field(None, ge=1)
    """Micro-batches per generation (None: `gradient_accumulation_steps`); orch `batch_size` =
    `per_device_train_batch_size` x this."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra chat-template variables (orch `client.chat_template_kwargs`)."""
    chat_template_path: str | None = None
    """Chat template for conversational prompts, as TRL's: a file path, or (tidal) the Jinja template itself inline
    (infer and train `chat_template`: one value for vLLM's rendering of the prompts, the trainer's tokenizer and
    the exports). None: the model's own; a model without one given chat prompts is refused before vLLM starts."""
    max_tool_calling_iterations: int | None = Field(None, ge=0)
    """Most tool-calling rounds per rollout with `GRPOTrainer(tools=...)` / `environment_factory` (orch
    `env[].tools.max_iterations`); None: until the completion budget ends the rollout."""
    # batch and optimization
    per_device_train_batch_size: int = Field(8, ge=1)
    """Completions per micro-batch (train `per_device_train_batch_size`: packed rows per micro-batch)."""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Micro-batches per optimizer step: train `steps_per_generation` = `steps_per_generation` / this."""
    learning_rate: float = Field(1e-6, gt=0)
    """Peak learning rate (train `learning_rate`)."""
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    """Schedule after warmup (train `lr_scheduler_type`; `constant_with_warmup` is `constant`)."""
    warmup_steps: int | float = Field(0, ge=0)
    """Linear warmup: a whole number of optimizer steps, or (transformers 5) a ratio in (0, 1) of the run's
    optimizer steps, ceil(ratio x steps) (train `warmup_steps`, in batches: ceil(steps / optimizer steps per
    batch))."""
    warmup_ratio: float = Field(0.0, ge=0, le=1)
    """Linear warmup over ceil(ratio x the run's optimizer steps) (transformers 4's key; train `warmup_steps` in
    batches). With `warmup_steps` > 0 as well, both must give the same steps (transformers would let `warmup_steps`
    win and ignore this; tidal ignores no key)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay (train `weight_decay`)."""
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW beta1 (train `adam_beta1`)."""
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    """AdamW beta2 (train `adam_beta2`)."""
    max_grad_norm: float = Field(1.0, ge=0)
    """Gradient clipping (train `max_grad_norm`)."""
    optim: Literal["adamw_torch", "adamw_torch_fused", "adamw_8bit", "adamw_bnb_8bit"] = "adamw_torch"
    """Optimizer (train `optimizer`: `adamw`, or `adamw_8bit` for the bitsandbytes ones)."""
    gradient_checkpointing: bool = True
    """Activation checkpointing (train `gradient_checkpointing`)."""
    bf16: bool = True
    """True: train `recipe: bf16` (bfloat16 on GPU; on CPU float32 weights with bfloat16 autocast, as TRL does
    there); False: `fp32`."""
    trust_remote_code: bool = False
    """Run the model repository's code (train and infer `trust_remote_code`)."""
    seed: int = 42
    """Seed of the trainer, the example sampler and vLLM's sampling (train/orch `seed`, orch `sampling.seed`)."""
    max_steps: int = Field(-1, ge=-1)
    """Optimizer steps; -1: `num_train_epochs` passes over the dataset (orch `max_steps` in batches)."""
    num_train_epochs: float = Field(3.0, gt=0)
    """Epochs when `max_steps` is -1."""
    # the GRPO objective: the loss keys are TRLAlgorithmKeys' (tidal.api.loss_keys)
    scale_rewards: Literal["group", "batch", "none"] | bool = "group"
    """Advantage scaling (orch `advantage.scale_rewards`; True is `group`, False `none`)."""
    reward_weights: list[float] | None = None
    """One weight per reward function (None: all 1)."""
    # vLLM
    # use_vllm: TRLAlgorithmKeys (it decides the importance-sampling correction, as in TRL)
    vllm_mode: Literal["server", "colocate"] = "colocate"
    """Either way tidal starts its own vLLM server beside the trainer, sharing the GPU (`tidal grpo`'s layout)."""
    vllm_server_host: str = "127.0.0.1"
    """Address tidal's vLLM server binds to (infer `host`)."""
    vllm_server_port: int = Field(8000, ge=1, le=65535)
    """Port of tidal's vLLM server (infer `port`)."""
    vllm_server_timeout: float = Field(240.0, gt=0)
    """Seconds to wait for the server to come up."""
    vllm_gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """vLLM's share of the GPU (infer `gpu_memory_utilization`; None: what the trainer leaves)."""
    vllm_tensor_parallel_size: int = Field(1, ge=1)
    """vLLM tensor parallelism (infer `tp`)."""
    vllm_max_model_length: int | None = Field(None, ge=16)
    """vLLM's context length (infer `max_model_len`; None: prompt + completion length)."""
    # logging, saving, evaluation
    logging_steps: int = Field(10, ge=1)
    """Progress line every N optimizer steps (train `logging_steps`, in batches); metrics.jsonl gets every step."""
    save_strategy: Literal["steps", "no"] = "steps"
    """`steps`: checkpoint every `save_steps`; `no`: none."""
    save_steps: int = Field(500, ge=1)
    """Checkpoint interval in optimizer steps (train/orch `ckpt.interval`, in batches)."""
    save_total_limit: int | None = Field(None, ge=1)
    """Checkpoints kept (train/orch `ckpt.keep_last`)."""
    report_to: str | list[str] = "none"
    """`none`, `wandb`, `tensorboard`, `all` or a list (orch `report_to`)."""
    run_name: str | None = None
    """W&B run name (orch `report_to.name`)."""
    eval_strategy: Literal["no", "steps"] = "no"
    """`steps`: evaluate on `eval_dataset` every `eval_steps` (orch `eval`)."""
    eval_steps: int | None = Field(None, ge=1)
    """Evaluation interval in optimizer steps (None: `logging_steps`)."""
    num_generations_eval: int | None = Field(None, ge=1)
    """Completions per eval prompt (orch `eval.rollouts_per_example`; None: `num_generations`)."""
    log_completions: bool = False
    """Log completion samples to the sinks (orch `report_to.samples`; samples.jsonl always has them)."""
    # accepted at TRL's default only (UNSUPPORTED)
    fp16: bool = False
    """Not supported (use bf16)."""
    push_to_hub: bool = False
    """Not supported."""
    hub_model_id: str | None = None
    """Not supported."""
    model_init_kwargs: dict[str, Any] | None = None
    """Not supported."""
    vllm_enable_sleep_mode: bool = False
    """Not supported."""
    generation_kwargs: dict[str, Any] | None = None
    """Not supported (the sampling keys above are)."""
    resume_from_checkpoint: str | None = None
    """Refused: as in transformers the trainer does not read it; pass it to
    `trainer.train(resume_from_checkpoint=...)`."""
    load_best_model_at_end: bool = False
    """Not supported."""
    num_completions_to_print: int | None = None
    """Not supported."""
    wandb_log_unique_prompts: bool = False
    """Not supported."""
    vllm_server_base_url: str | None = None
    """Not supported: tidal starts its own server."""
    shuffle_dataset: bool = True
    """Rows are drawn at random with the seed; False is not supported."""
    remove_unused_columns: bool = False
    """Every column reaches the reward functions; True is not supported."""
    use_transformers_paged: bool = False
    """Not supported."""
    vllm_structured_outputs_regex: str | None = None
    """Not supported."""
    router_aux_loss_coef: float | None = None
    """Not supported (TRL 1.16's default None: the model config's own coefficient)."""
    ds3_gather_for_generation: bool = True
    """Not supported."""
    pad_to_multiple_of: int | str | None = "auto"
    """Not supported (TRL 1.16's default `auto`); tidal packs sequences instead of padding them."""
    cache_implementation: str | None = None
    """Not supported."""
    vllm_model_impl: str = "vllm"
    """Not supported."""
    vllm_group_port: int = 51216
    """Not supported."""
    log_multimodal: bool = True
    """Not supported."""
    log_unique_prompts: bool = False
    """Not supported."""
    log_completions_hub_repo: str | None = None
    """Not supported."""
    use_transformers_continuous_batching: bool = False
    """Not supported."""
    transformers_continuous_batching_config: dict[str, Any] | None = None
    """Not supported."""

    def __init__(self, output_dir: str | None = None, **data: Any) -> None:
        """TRL's signature: `GRPOConfig(output_dir, **kwargs)`."""
        if output_dir is not None:
            data["output_dir"] = output_dir
        super().__init__(**data)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if key in REMOVED:
                    raise ValueError(f"GRPOConfig key '{key}' {REMOVED[key]}")
                if key not in cls.model_fields:
                    near = difflib.get_close_matches(key, list(cls.model_fields), n=1, cutoff=0.6)
                    raise ValueError(f"GRPOConfig key '{key}' is not a TRL GRPOConfig key tidal knows"
                                     f"{f' (did you mean {near[0]!r}?)' if near else ''}; docs/trl.md lists them")
        return data

    @model_validator(mode="after")
    def _schedule_kwargs(self) -> GRPOConfig:
        schedule_kwargs(self)  # refuses, at construction, an argument tidal's schedule has no knob for
        return self


MAPPING: dict[str, str] = {
    "output_dir": "orch/train `output_dir`", "num_generations": "orch `rollouts_per_example`",
    "max_completion_length": "orch `sampling.max_tokens`",
    "max_prompt_length": "orch `seq_len` (+ max_completion_length), `long_prompts: truncate`",
    "temperature": "orch `sampling.temperature`", "top_p": "orch `sampling.top_p`", "top_k": "orch `sampling.top_k`",
    "min_p": "orch `sampling.min_p`", "repetition_penalty": "orch `sampling.repetition_penalty`",
    "generation_batch_size": "orch `batch_size`", "steps_per_generation": "orch `batch_size` / train "
    "`steps_per_generation`", "chat_template_kwargs": "orch `client.chat_template_kwargs`",
    "chat_template_path": "infer and train `chat_template`",
    "max_tool_calling_iterations": "the tool loop's cap (orch `env[].tools.max_iterations` in YAML)",
    "per_device_train_batch_size": "train `per_device_train_batch_size`",
    "gradient_accumulation_steps": "train `steps_per_generation` (optimizer steps per batch)",
    "learning_rate": "train `learning_rate`", "lr_scheduler_type": "train `lr_scheduler_type`",
    "warmup_steps": "train `warmup_steps` (batches; < 1: a ratio of the run's optimizer steps)",
    "warmup_ratio": "train `warmup_steps` (ceil(ratio x the run's optimizer steps), in batches)",
    "weight_decay": "train `weight_decay`",
    "adam_beta1": "train `adam_beta1`", "adam_beta2": "train `adam_beta2`",
    "max_grad_norm": "train `max_grad_norm`", "optim": "train `optimizer`",
    "gradient_checkpointing": "train `gradient_checkpointing`", "bf16": "train `recipe`",
    "seed": "train/orch `seed`, orch `sampling.seed`", "max_steps": "orch `max_steps` (batches)",
    "num_train_epochs": "orch `max_steps` when max_steps is -1", "scale_rewards": "orch `advantage.scale_rewards`",
    "reward_weights": "the reward functions' weights (orch `reward_funcs[].weight`)",
    "trust_remote_code": "train/infer `trust_remote_code`",
    "vllm_mode": "(tidal's co-located server either way)", "vllm_server_host": "infer `host`",
    "vllm_server_port": "infer `port`", "vllm_server_timeout": "the launcher's wait for vLLM",
    "vllm_gpu_memory_utilization": "infer `gpu_memory_utilization`", "vllm_tensor_parallel_size": "infer `tp`",
    "vllm_max_model_length": "infer `max_model_len`", "logging_steps": "train `logging_steps` (batches)",
    "save_strategy": "train/orch `ckpt.interval` (none for `no`)",
    "save_steps": "train/orch `ckpt.interval` (batches)", "save_total_limit": "train/orch `ckpt.keep_last`",
    "report_to": "orch `report_to` (wandb, tensorboard)", "run_name": "orch `report_to.name`",
    "eval_strategy": "orch `eval` (the eval dataset)", "eval_steps": "orch `eval.interval` (batches)",
    "num_generations_eval": "orch `eval.rollouts_per_example`", "log_completions": "orch `report_to.samples`",
}
"""TRL key -> where it goes in tidal (docs/trl.md's table)."""
MAPPING |= ALGORITHM_MAPPING

PEFT_KEYS = {"r": "lora_rank", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
             "target_modules": "lora_target_modules"}
"""peft.LoraConfig attribute -> train key."""
PEFT_DEFAULTS: dict[str, Any] = {"bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None,
                                 "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
                                 "init_lora_weights": True, "exclude_modules": None, "lora_bias": False}
"""peft.LoraConfig attributes tidal accepts at these values only (its LoRA is plain LoRA)."""


@dataclass(frozen=True)
class Derived:
    """`to_tidal`'s result: the three configs and the numbers behind them."""

    train: TrainConfig
    infer: InferConfig
    orch: OrchConfig
    optimizer_steps_per_batch: int
    """Optimizer steps one rollout batch makes (without `num_iterations`)."""


def batches(steps: int, per_batch: int) -> int:
    """TRL optimizer steps -> tidal batches (at least 1)."""
    return max(1, math.ceil(steps / per_batch))


def peft_keys(peft_config: Any) -> dict[str, Any]:
    """Train keys of a `peft.LoraConfig` (duck-typed: no peft import; other settings must be peft's defaults), or
    full fine-tuning (`lora: false`) without one, as in TRL."""
    if peft_config is None:
        return {"lora": False}  # TRL: no peft_config trains every weight
    def changed(key: str, default: Any) -> bool:
        value = getattr(peft_config, key, default)
        return bool(value != default and not (default in (None, {}) and not value))  # peft: None or {} alike

    wrong = [k for k, v in PEFT_DEFAULTS.items() if changed(k, v)]
    if wrong:
        raise ValueError(f"peft_config.{wrong[0]} = {getattr(peft_config, wrong[0])!r} is not supported by tidal "
                         f"(plain LoRA only: r, lora_alpha, lora_dropout, target_modules); leave it at "
                         f"{PEFT_DEFAULTS[wrong[0]]!r}")
    out: dict[str, Any] = {}
    for attr, key in PEFT_KEYS.items():
        value = getattr(peft_config, attr, None)
        if value is None:
            continue
        if key == "lora_target_modules":  # peft's "all-linear" is tidal's too (`tidal.models.lora`)
            value = value if value == "all-linear" else [value] if isinstance(value, str) else sorted(value)
        out[key] = value
    return out


def generation_shape(args: GRPOConfig) -> tuple[int, int]:
    """(completions per generation = orch `batch_size`, optimizer steps per generation)."""
    if args.generation_batch_size is not None and args.steps_per_generation is not None:
        raise ValueError("GRPOConfig: set generation_batch_size or steps_per_generation, not both")
    per = args.per_device_train_batch_size
    if args.generation_batch_size is not None:
        if args.generation_batch_size % per:
            raise ValueError(f"GRPOConfig: generation_batch_size ({args.generation_batch_size}) must be a multiple of "
                             f"per_device_train_batch_size ({per})")
        spg = args.generation_batch_size // per
    else:
        spg = args.steps_per_generation or args.gradient_accumulation_steps
    ga = args.gradient_accumulation_steps
    if spg % ga:
        raise ValueError(f"GRPOConfig: steps_per_generation ({spg}) must be a multiple of gradient_accumulation_steps "
                         f"({ga}) in tidal: one rollout batch trains whole optimizer steps")
    if (per * spg) % args.num_generations:
        raise ValueError(f"GRPOConfig: the generation batch, per_device_train_batch_size x steps_per_generation = "
                         f"{per * spg}, must be a multiple of num_generations ({args.num_generations})")
    return per * spg, spg // ga


def scale_rewards(value: str | bool) -> str:
    """TRL's `scale_rewards` (a mode, or the older bool) -> orch `advantage.scale_rewards`."""
    if isinstance(value, bool):
        return "group" if value else "none"
    return value


def report_section(args: GRPOConfig) -> dict[str, Any] | None:
    sinks = [args.report_to] if isinstance(args.report_to, str) else list(args.report_to)
    sinks = ["wandb", "tensorboard"] if "all" in sinks else [s for s in sinks if s != "none"]
    bad = [s for s in sinks if s not in ("wandb", "tensorboard")]
    if bad:
        raise ValueError(f"GRPOConfig report_to '{bad[0]}' is not supported by tidal (wandb, tensorboard, all, none)")
    if not sinks:
        if args.run_name is not None or args.log_completions:
            raise ValueError(f"GRPOConfig {'run_name' if args.run_name is not None else 'log_completions'} needs a "
                             f"report_to sink (wandb, tensorboard); samples.jsonl gets completions anyway")
        return None
    return {"wandb": "wandb" in sinks, "tensorboard": "tensorboard" in sinks, "name": args.run_name,
            "samples": True if args.log_completions else None}


def warmup_batches(args: GRPOConfig, batches_total: int, opt_per_batch: int) -> int:
    """TRL's warmup (`warmup_steps`: optimizer steps, or a ratio below 1; `warmup_ratio`) of a run of
    `batches_total` batches of `opt_per_batch` optimizer steps -> train `warmup_steps` (batches, rounded up).
    transformers' `get_warmup_steps`: a ratio r gives ceil(r x the run's optimizer steps)."""
    total = batches_total * opt_per_batch

    def steps(key: str, value: float) -> int:
        if value >= 1 and value != int(value):
            raise ValueError(f"GRPOConfig {key} {value}: give a whole number of optimizer steps, or a ratio below 1")
        return int(value) if value >= 1 else math.ceil(value * total)

    by_steps = steps("warmup_steps", args.warmup_steps) if args.warmup_steps > 0 else None
    by_ratio = math.ceil(args.warmup_ratio * total) if args.warmup_ratio > 0 else None
    if by_steps is not None and by_ratio is not None and by_steps != by_ratio:
        raise ValueError(f"GRPOConfig warmup_steps {args.warmup_steps} ({by_steps} optimizer steps) and warmup_ratio "
                         f"{args.warmup_ratio} ({by_ratio} of the run's {total}) disagree; transformers would use "
                         f"warmup_steps and ignore warmup_ratio: set one of them")
    warmup = by_steps if by_steps is not None else by_ratio or 0
    return math.ceil(warmup / opt_per_batch)


def train_keys(args: GRPOConfig, model: str, per_batch: int, warmup: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": model, "output_dir": args.output_dir, "per_device_train_batch_size": args.per_device_train_batch_size,
        "steps_per_generation": per_batch, "learning_rate": args.learning_rate,
        "lr_scheduler_type": "constant" if args.lr_scheduler_type == "constant_with_warmup" else args.lr_scheduler_type,
        "warmup_steps": warmup, "weight_decay": args.weight_decay, "adam_beta1": args.adam_beta1,
        "adam_beta2": args.adam_beta2, "max_grad_norm": args.max_grad_norm,
        "optimizer": "adamw_8bit" if "8bit" in args.optim else "adamw",
        "gradient_checkpointing": args.gradient_checkpointing, "seed": args.seed,
        "trust_remote_code": args.trust_remote_code, "chat_template": args.chat_template_path,
        "recipe": "bf16" if args.bf16 else "fp32",
        "logging_steps": batches(args.logging_steps, per_batch * args.num_iterations)}
    return out | algorithm_train_keys(args) | schedule_kwargs(args)


def schedule_kwargs(args: GRPOConfig) -> dict[str, Any]:
    """`lr_scheduler_kwargs` -> the train keys of tidal's schedule: cosine's `num_cycles` is
    `lr_cosine_cycles`; every other argument has no knob in tidal's schedules and is refused, naming it."""
    kwargs = dict(args.lr_scheduler_kwargs or {})
    out: dict[str, Any] = {}
    if args.lr_scheduler_type == "cosine" and "num_cycles" in kwargs:
        out["lr_cosine_cycles"] = float(kwargs.pop("num_cycles"))
    if kwargs:
        knobs = "num_cycles" if args.lr_scheduler_type == "cosine" else "none"
        raise ValueError(f"GRPOConfig lr_scheduler_kwargs {sorted(kwargs)} have no knob in tidal's "
                         f"'{args.lr_scheduler_type}' schedule (its knobs: {knobs}; tidal's linear and constant "
                         f"schedules take none, its cosine only num_cycles)")
    return out


def advantage_keys(args: GRPOConfig) -> dict[str, Any]:
    """Orch `advantage`: `scale_rewards`, or GDPO's `normalize_then_sum`, which ignores `scale_rewards` (as in
    TRL 1.16: it always normalizes per group and then over the batch)."""
    if args.multi_objective_aggregation == "normalize_then_sum":
        return {"multi_objective_aggregation": "normalize_then_sum"}
    return {"scale_rewards": scale_rewards(args.scale_rewards)}


def to_tidal(args: GRPOConfig, model: str, train_rows: int, num_reward_funcs: int, peft_config: Any = None,
             eval_names: Sequence[str] = ()) -> Derived:
    """The train, infer and orch configs that run `args` (TRL semantics, see the module docs) on `model`, for a
    dataset of `train_rows` rows, `num_reward_funcs` reward functions and the eval datasets `eval_names` (each an
    orch `eval.env` entry of that name, its `args` left for the caller). Raises ValueError naming the key."""
    if args.reward_weights is not None and len(args.reward_weights) != num_reward_funcs:
        raise ValueError(f"GRPOConfig reward_weights has {len(args.reward_weights)} weights for {num_reward_funcs} "
                         f"reward functions")
    batch_size, per_batch = generation_shape(args)
    opt_per_batch = per_batch * args.num_iterations
    if args.max_steps == -1:
        max_steps = max(1, math.ceil(args.num_train_epochs * train_rows * args.num_generations / batch_size))
    else:
        max_steps = batches(args.max_steps, opt_per_batch)
    if args.max_prompt_length is None and args.vllm_max_model_length is None:
        raise ValueError("GRPOConfig: tidal needs a length bound: set max_prompt_length or vllm_max_model_length")
    seq_len = (args.max_prompt_length + args.max_completion_length if args.max_prompt_length is not None
               else int(args.vllm_max_model_length or 0))
    ckpt: dict[str, Any] = {"keep_last": args.save_total_limit}
    if args.save_strategy == "steps":
        ckpt["interval"] = batches(args.save_steps, opt_per_batch)
    sampling: dict[str, Any] = {"max_tokens": args.max_completion_length, "temperature": args.temperature,
                                "top_p": args.top_p, "top_k": args.top_k or -1, "min_p": args.min_p or 0.0,
                                "repetition_penalty": args.repetition_penalty, "seed": args.seed}
    orch: dict[str, Any] = {
        "model": {"name": model}, "env": [{"id": "dataset", "args": {}}], "batch_size": batch_size,
        "rollouts_per_example": args.num_generations, "seq_len": seq_len, "max_steps": max_steps,
        "long_prompts": "truncate" if args.max_prompt_length is not None else "skip",
        "output_dir": args.output_dir, "seed": args.seed, "sampling": sampling,
        "advantage": advantage_keys(args),
        "ckpt": ckpt, "report_to": report_section(args),
        "client": {"chat_template_kwargs": args.chat_template_kwargs or {}}}
    if not args.corrects_is():  # nothing corrects the lag: sample on-policy, as TRL does (on a GPU too)
        orch["max_async_level"] = 0
    if args.eval_strategy == "steps":
        if not eval_names:
            raise ValueError("GRPOConfig eval_strategy 'steps' needs an eval_dataset")
        orch["eval"] = {"env": [{"id": "dataset", "name": n, "args": {}} for n in eval_names], "num_examples": -1,
                        "interval": batches(args.eval_steps or args.logging_steps, opt_per_batch),
                        "rollouts_per_example": args.num_generations_eval or args.num_generations}
    elif args.num_generations_eval is not None or args.eval_steps is not None:
        raise ValueError("GRPOConfig eval_steps / num_generations_eval need eval_strategy='steps'")
    infer: dict[str, Any] = {"model": model, "host": args.vllm_server_host, "port": args.vllm_server_port,
                             "trust_remote_code": args.trust_remote_code, "chat_template": args.chat_template_path,
                             "tp": args.vllm_tensor_parallel_size,
                             "max_model_len": args.vllm_max_model_length or seq_len}
    if args.vllm_gpu_memory_utilization is not None:
        infer["gpu_memory_utilization"] = args.vllm_gpu_memory_utilization
    train = train_keys(args, model, per_batch, warmup_batches(args, max_steps, opt_per_batch)) | peft_keys(peft_config)
    if not args.corrects_is():
        train["max_async_level"] = 0
    train["ckpt"] = dict(ckpt)
    return Derived(TrainConfig.model_validate(train), InferConfig.model_validate(infer),
                   OrchConfig.model_validate(orch), per_batch)
