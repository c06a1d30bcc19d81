"""The trainer's config refusals that need no weights and no device, in one place: `grpo-train` runs them before it
builds the policy, and `tidal grpo` / `GRPOTrainer(...)` run the same functions on the derived train config before
anything starts (`tidal.colocate.preflight`), so none of them can stop a run whose vLLM is already up.

Each raises `ConfigError` (exit 2) naming the key and what would be valid. Cheap and torch-free unless a check
applies (`prompt_sharing: true`, `rope_scaling` or a vision-language model read the model's transformers config;
`liger_kernel` asks torch whether the trainer's device has CUDA).
"""

from __future__ import annotations

from pathlib import Path

from tidal.config.load import ConfigError
from tidal.config.train import TrainConfig
from tidal.models.config import model_config
from tidal.models.limits import check_lengths
from tidal.models.sources import resolve_model


def publishes_merged(cfg: TrainConfig) -> bool:
    """Each policy is published as merged (or, fully fine-tuned, all) weights rather than a LoRA adapter."""
    return cfg.broadcast_merged or not cfg.lora


def check_qerl(cfg: TrainConfig) -> None:
    """QeRL noise travels inside the published merged weights or the NCCL push: it needs one of them (not the
    LoRA-adapter path, whose adapters cannot change a norm), and a known run length."""
    if not cfg.noise_scheduler.enabled:
        return
    if not publishes_merged(cfg) and cfg.weight_broadcast.type != "nccl":
        raise ConfigError("train noise_scheduler.enabled: the noisy RMSNorm weights reach vLLM inside the merged "
                          "weights of each policy or the NCCL push, and a LoRA adapter cannot carry them; set orch "
                          "weight_broadcast.reload: merged (train broadcast_merged: true; `tidal grpo` on CPU does "
                          "it) or weight_broadcast.type: nccl")
    if cfg.max_steps < 1:
        raise ConfigError("train noise_scheduler.enabled needs train max_steps (the schedule's intervals are "
                          "fractions of the run)")


def check_prompt_sharing(cfg: TrainConfig) -> None:
    """`prompt_sharing: true` with a model it cannot apply to is a config error (exit 2)."""
    if cfg.prompt_sharing is not True:
        return
    from tidal.trainer.model.attention import prompt_sharing_blocker
    from tidal.trainer.model.hf import load_model_config

    why = prompt_sharing_blocker(load_model_config(resolve_model(cfg.model), cfg.trust_remote_code, cfg.rope_scaling),
                                 cfg.sequence_len)
    if why is not None:
        raise ConfigError(f"train prompt_sharing: true, but {cfg.model} cannot share prompts: {why}; set "
                          f"prompt_sharing to auto (on where it applies) or false")


def check_model_build(cfg: TrainConfig, config: dict) -> None:
    """How the trainer builds the model (`tidal.trainer.model.load`): train `rope_scaling` must be valid for it, and a
    vision-language model must be one whose image inputs the trainer builds. Loads the transformers config (and
    torch) only when one of them applies."""
    if not cfg.rope_scaling and "vision_config" not in config:
        return
    from tidal.trainer.model.hf import auto_model_class, load_model_config

    auto_model_class(load_model_config(resolve_model(cfg.model), cfg.trust_remote_code, cfg.rope_scaling), cfg.model)


def check_train(cfg: TrainConfig) -> None:
    """Every up-front refusal of a train config (`grpo-train`, and `tidal grpo` on its derived config)."""
    config = model_config(cfg.model, missing_ok=True)
    check_model_build(cfg, config)
    check_lengths(cfg.model, config, {"train sequence_len": cfg.sequence_len}, cfg.rope_scaling)
    check_qerl(cfg)
    check_prompt_sharing(cfg)
    check_router_replay(cfg)
    check_liger(cfg, config)
    if cfg.export.gguf and config:
        from tidal.trainer.publish.gguf_out import check_gguf_export

        check_gguf_export(config, Path(resolve_model(cfg.model)), "train", cfg.rope_scaling)


def check_liger(cfg: TrainConfig, config: dict) -> None:
    """`liger_kernel` on a model Liger's kernels do not cover (`tidal.trainer.model.kernels.liger.FAMILIES`), on a
    trainer device without CUDA, or without liger-kernel installed. Imports torch only when it is set."""
    if not cfg.liger_kernel:
        return
    from tidal.trainer.model.kernels.liger import check_config, check_runtime
    from tidal.trainer.model.load import resolve_device

    if config:  # a missing model directory is refused where the model is loaded
        check_config(cfg.liger_kernel, config, cfg.model)
    check_runtime(cfg.liger_kernel, resolve_device(cfg.device))


def check_router_replay(cfg: TrainConfig) -> None:
    """`router_replay: true` on a model whose routes tidal cannot replay (dense, or another MoE architecture)."""
    if cfg.router_replay is True:
        from tidal.models.arch import read_arch
        from tidal.models.routes import resolve_router_replay

        resolve_router_replay(True, read_arch(resolve_model(cfg.model)), cfg.model, None)
