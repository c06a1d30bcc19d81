"""transformers' `TrainingArguments` fields that TRL 1.16's `GRPOConfig` inherits, beyond the ones `GRPOConfig`
maps itself (`tidal.api.grpo_config`): each has its effect or is refused with the reason.

TRL 1.16's `GRPOConfig` has 112 fields from `TrainingArguments` (`trl_1_16_fields.json`, origin
"TrainingArguments"). A TRL script sets some of them for a trainer tidal does not have (a torch DataLoader, DDP,
DeepSpeed, the Hub, an eval-loss pass). `TrainingArgumentsFields` declares the rest of them, so that a script
that passes one is understood: at transformers' default each is accepted (TRL's behaviour is tidal's there); any
other value is an error that names the key, says why tidal cannot honour it and gives the default.
`EFFECTS` are the fields whose every value is accepted: `use_cpu` (checked against the machine by
`GRPOTrainer`) and `do_train` / `do_eval` / `do_predict` (which transformers leaves to the user's script too).
`REMOVED` gives the reason for the `TrainingArguments` fields older transformers had and TRL 1.16's `GRPOConfig`
no longer takes.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, model_validator

from tidal.config.base import StrictModel

EFFECTS = frozenset({"use_cpu", "do_train", "do_eval", "do_predict"})
"""Inherited fields whose every value is accepted, each with its effect (the field's doc line says which)."""

REMOVED: dict[str, str] = {
    "logging_dir": "was removed from TrainingArguments in transformers 5 (TRL 1.16's GRPOConfig has no such "
                   "field); tidal writes tensorboard logs to {output_dir}/tensorboard/ (report_to='tensorboard')",
    "evaluation_strategy": "was renamed eval_strategy in transformers 4.46",
    "no_cuda": "was replaced by use_cpu in transformers 4.34",
}
"""Keys of older transformers' TrainingArguments -> why GRPOConfig refuses them (TRL 1.16 refuses them too)."""


class TrainingArgumentsFields(StrictModel):
    """The inherited TrainingArguments fields `GRPOConfig` does not map itself; at their defaults unless `EFFECTS`."""

    INHERITED_REFUSED: ClassVar[frozenset[str]]
    """Fields accepted at transformers' default only (all but `EFFECTS`); filled in below the class."""

    optim_args: str | None = None
    """Refused: tidal's optimizers take no extra arguments string (optim names AdamW / 8-bit AdamW)."""
    optim_target_modules: str | list[str] | None = None
    """Refused: only GaLore/APOLLO-style optimizers read it, and tidal has none."""
    average_tokens_across_devices: bool = True
    """Refused: tidal normalizes the loss over each optimizer step's own tokens (train loss.loss_type); False is not
    supported."""
    label_smoothing_factor: float = 0.0
    """Refused: GRPO's loss has no labels to smooth."""
    bf16_full_eval: bool = False
    """Refused: tidal's evaluation is rollouts scored by the reward functions (orch `eval`), without an eval-loss
    pass."""
    fp16_full_eval: bool = False
    """Refused: tidal's evaluation is rollouts scored by the reward functions (orch `eval`), without an eval-loss
    pass."""
    tf32: bool | None = None
    """Refused: tidal sets matmul precision from train `recipe`; TF32 is not configurable."""
    torch_compile_backend: str | None = None
    """Refused: torch_compile=True compiles each decoder layer with tidal's own backend (train `compile_layers`);
    another backend is not configurable."""
    torch_compile_mode: str | None = None
    """Refused: torch_compile=True compiles each decoder layer in tidal's own mode (train `compile_layers`); another
    mode is not configurable."""
    liger_kernel_config: dict[str, bool] | None = None
    """Refused: use_liger_kernel=True applies a fixed set of Liger kernels (train `liger_kernel: [rms_norm, swiglu,
    rope]`); a per-kernel selection is not supported."""
    use_cache: bool = False
    """Refused: training forward passes never use a KV cache in tidal (generation is vLLM's)."""
    neftune_noise_alpha: float | None = None
    """Refused: NEFTune embedding noise is not implemented."""
    torch_empty_cache_steps: int | None = None
    """Refused: tidal does not empty the CUDA cache on a schedule."""
    auto_find_batch_size: bool = False
    """Refused: tidal sizes micro-batches by token count (train micro-batch keys), not by retrying on OOM."""
    logging_strategy: str = 'steps'
    """Refused: tidal records every step in metrics.jsonl (and to the callbacks' on_log); only 'steps' is supported."""
    logging_first_step: bool = False
    """Refused: tidal's metrics.jsonl records every step, the first included, and its progress line follows
    logging_steps (set logging_steps=1 for a line per step)."""
    log_on_each_node: bool = True
    """Refused: the metrics are written once, by the run's orchestrator."""
    logging_nan_inf_filter: bool = True
    """Refused: tidal logs the measured values; NaN/inf are reported as they are."""
    include_num_input_tokens_seen: str | bool = 'no'
    """Refused: not implemented (the metrics count tokens per step)."""
    log_level: str = 'passive'
    """Refused: tidal's processes log at their own levels (their logs are in {output_dir}/logs)."""
    log_level_replica: str = 'warning'
    """Refused: tidal's processes log at their own levels (their logs are in {output_dir}/logs)."""
    disable_tqdm: bool | None = None
    """Refused: tidal prints progress lines, not tqdm bars."""
    project: str = 'huggingface'
    """Refused: tidal reports to wandb and tensorboard (report_to), not trackio."""
    trackio_space_id: str | None = None
    """Refused: tidal reports to wandb and tensorboard (report_to), not trackio."""
    trackio_bucket_id: str | None = None
    """Refused: tidal reports to wandb and tensorboard (report_to), not trackio."""
    trackio_static_space_id: str | bool | None = None
    """Refused: tidal reports to wandb and tensorboard (report_to), not trackio."""
    eval_delay: float = 0
    """Refused: tidal's evaluation is rollouts scored by the reward functions (orch `eval`), without an eval-loss
    pass."""
    prediction_loss_only: bool = False
    """Refused: tidal's evaluation is rollouts scored by the reward functions (orch `eval`), without an eval-loss
    pass."""
    eval_do_concat_batches: bool = True
    """Refused: tidal's evaluation is rollouts scored by the reward functions (orch `eval`), without an eval-loss
    pass."""
    eval_use_gather_object: bool = False
    """Refused: tidal's evaluation is rollouts scored by the reward functions (orch `eval`), without an eval-loss
    pass."""
    eval_accumulation_steps: int | None = None
    """Refused: tidal's evaluation is rollouts scored by the reward functions (orch `eval`), without an eval-loss
    pass."""
    include_for_metrics: list[str] = Field(default_factory=list)
    """Refused: tidal's evaluation is rollouts scored by the reward functions (orch `eval`), without an eval-loss
    pass."""
    batch_eval_metrics: bool = False
    """Refused: tidal's evaluation is rollouts scored by the reward functions (orch `eval`), without an eval-loss
    pass."""
    save_only_model: bool = False
    """Refused: tidal's checkpoints hold the optimizer and scheduler state so that a run can resume (final/ holds the
    model)."""
    save_on_each_node: bool = False
    """Refused: checkpoints are written once, into the shared output_dir."""
    enable_jit_checkpoint: bool = False
    """Refused: not implemented (checkpoints follow save_steps)."""
    hub_token: str | None = None
    """Refused: tidal does not push to the Hub (push_to_hub is refused)."""
    hub_private_repo: bool | None = None
    """Refused: tidal does not push to the Hub (push_to_hub is refused)."""
    hub_strategy: str = 'every_save'
    """Refused: tidal does not push to the Hub (push_to_hub is refused)."""
    hub_always_push: bool = False
    """Refused: tidal does not push to the Hub (push_to_hub is refused)."""
    hub_revision: str | None = None
    """Refused: tidal does not push to the Hub (push_to_hub is refused)."""
    metric_for_best_model: str | None = None
    """Refused: load_best_model_at_end is refused: tidal keeps the last save_total_limit checkpoints."""
    greater_is_better: bool | None = None
    """Refused: load_best_model_at_end is refused: tidal keeps the last save_total_limit checkpoints."""
    ignore_data_skip: bool = False
    """Refused: a resumed run draws fresh examples with the seed; it does not replay the data order."""
    restore_callback_states_from_checkpoint: bool = False
    """Refused: callback state is not checkpointed."""
    full_determinism: bool = False
    """Refused: tidal does not switch torch to deterministic algorithms; seed makes sampling reproducible."""
    data_seed: int | None = None
    """Refused: one seed draws the examples and seeds the sampling (orch `seed`); a separate data seed is not
    supported."""
    use_cpu: bool = False
    """True: the run is on the CPU (tidal runs on the CPU where no CUDA GPU is visible); on a machine with one,
    GRPOTrainer refuses it (hide the GPUs: CUDA_VISIBLE_DEVICES='')."""
    accelerator_config: dict[str, Any] | str | None = None
    """Refused: tidal's trainer is distributed by train `gpus` (torchrun, FSDP2) that `tidal grpo` sets up;
    TRL/accelerate's settings have no trainer to reach."""
    parallelism_config: Any = None
    """Refused: tidal's trainer is distributed by train `gpus` (torchrun, FSDP2) that `tidal grpo` sets up;
    TRL/accelerate's settings have no trainer to reach."""
    dataloader_drop_last: bool = False
    """Refused: tidal has no torch DataLoader: the orchestrator draws the dataset's rows in process, a batch's prompts
    at a time."""
    dataloader_num_workers: int = 0
    """Refused: tidal has no torch DataLoader: the orchestrator draws the dataset's rows in process, a batch's prompts
    at a time."""
    dataloader_pin_memory: bool = True
    """Refused: tidal has no torch DataLoader: the orchestrator draws the dataset's rows in process, a batch's prompts
    at a time."""
    dataloader_persistent_workers: bool = False
    """Refused: tidal has no torch DataLoader: the orchestrator draws the dataset's rows in process, a batch's prompts
    at a time."""
    dataloader_prefetch_factor: int | None = None
    """Refused: tidal has no torch DataLoader: the orchestrator draws the dataset's rows in process, a batch's prompts
    at a time."""
    dataloader_multiprocessing_context: str | None = None
    """Refused: tidal has no torch DataLoader: the orchestrator draws the dataset's rows in process, a batch's prompts
    at a time."""
    dataloader_in_order: bool = True
    """Refused: tidal has no torch DataLoader: the orchestrator draws the dataset's rows in process, a batch's prompts
    at a time."""
    label_names: list[str] | None = None
    """Refused: GRPO's loss has no label columns."""
    train_sampling_strategy: str = 'random'
    """Refused: tidal draws prompts at random with the seed ('random'); other orders are not supported."""
    length_column_name: str = 'length'
    """Refused: tidal does not group prompts by length."""
    ddp_find_unused_parameters: bool | None = None
    """Refused: tidal's trainer is distributed by train `gpus` (torchrun, FSDP2) that `tidal grpo` sets up;
    TRL/accelerate's settings have no trainer to reach."""
    ddp_bucket_cap_mb: int | None = None
    """Refused: tidal's trainer is distributed by train `gpus` (torchrun, FSDP2) that `tidal grpo` sets up;
    TRL/accelerate's settings have no trainer to reach."""
    ddp_broadcast_buffers: bool | None = None
    """Refused: tidal's trainer is distributed by train `gpus` (torchrun, FSDP2) that `tidal grpo` sets up;
    TRL/accelerate's settings have no trainer to reach."""
    ddp_static_graph: bool | None = None
    """Refused: tidal's trainer is distributed by train `gpus` (torchrun, FSDP2) that `tidal grpo` sets up;
    TRL/accelerate's settings have no trainer to reach."""
    ddp_backend: str | None = None
    """Refused: tidal's trainer is distributed by train `gpus` (torchrun, FSDP2) that `tidal grpo` sets up;
    TRL/accelerate's settings have no trainer to reach."""
    ddp_timeout: int = 1800
    """Refused: tidal's trainer is distributed by train `gpus` (torchrun, FSDP2) that `tidal grpo` sets up;
    TRL/accelerate's settings have no trainer to reach."""
    fsdp: str | list[str] | None = None
    """Refused: tidal's trainer is distributed by train `gpus` (torchrun, FSDP2) that `tidal grpo` sets up;
    TRL/accelerate's settings have no trainer to reach."""
    fsdp_config: dict[str, Any] | str | None = None
    """Refused: tidal's trainer is distributed by train `gpus` (torchrun, FSDP2) that `tidal grpo` sets up;
    TRL/accelerate's settings have no trainer to reach."""
    deepspeed: dict[str, Any] | str | None = None
    """Refused: tidal's trainer is distributed by train `gpus` (torchrun, FSDP2) that `tidal grpo` sets up;
    TRL/accelerate's settings have no trainer to reach."""
    debug: str | list[str] = ''
    """Refused: transformers' TPU/underflow debug modes are not implemented."""
    skip_memory_metrics: bool = True
    """Refused: tidal does not record transformers' memory metrics."""
    do_train: bool = False
    """Read by your script, not by the trainer (as in transformers): any value."""
    do_eval: bool = False
    """Read by your script, not by the trainer (as in transformers): any value."""
    do_predict: bool = False
    """Read by your script, not by the trainer (as in transformers): any value."""
    local_rank: int = -1
    """Refused: tidal's launcher assigns ranks itself (torchrun)."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_inherited(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for key in sorted(set(data) & set(REMOVED)):
            raise ValueError(f"GRPOConfig key '{key}' {REMOVED[key]}")
        for key in sorted(set(data) & TrainingArgumentsFields.INHERITED_REFUSED):
            default = TrainingArgumentsFields.model_fields[key].get_default(call_default_factory=True)
            if data[key] != default:
                why = " ".join(str(TrainingArgumentsFields.model_fields[key].description).split())
                why = why.removeprefix("Refused: ")
                raise ValueError(f"GRPOConfig key '{key}' (inherited from transformers' TrainingArguments) is refused: "
                                 f"{why.rstrip('.')}; leave it out or set it to its default {default!r}")
        return data


TrainingArgumentsFields.INHERITED_REFUSED = frozenset(TrainingArgumentsFields.model_fields) - EFFECTS
