"""`GRPOConfig` (TRL's key names) -> tidal's train / infer / orch configs: every key maps somewhere with an effect
or is refused with an error naming it; TRL's batch arithmetic (generation batch, optimizer steps per
generation, num_iterations) becomes tidal's batches; peft's LoraConfig becomes the train LoRA keys."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tidal import GRPOConfig as LazyGRPOConfig
from tidal.api.grpo_config import MAPPING, GRPOConfig, to_tidal
from tidal.api.training_args import EFFECTS, TrainingArgumentsFields
from tidal.config.train import TrainConfig

DOCS = Path(__file__).resolve().parents[2] / "docs" / "trl.md"


def derive(n_rows: int = 10, funcs: int = 1, peft: Any = None, eval_: bool = False, **kw: Any):
    return to_tidal(GRPOConfig(**kw), "tidal:tiny-reverse", n_rows, funcs, peft, eval_names=["eval"] if eval_ else [])


def dump(d: Any) -> dict[str, Any]:
    return {"train": d.train.model_dump(), "infer": d.infer.model_dump(), "orch": d.orch.model_dump()}


def test_every_key_is_mapped_or_refused_and_documented():
    refused = GRPOConfig.UNSUPPORTED | set(GRPOConfig.REFUSED) | TrainingArgumentsFields.INHERITED_REFUSED
    assert not set(MAPPING) & refused
    keys = set(GRPOConfig.model_fields) - EFFECTS  # EFFECTS: tests/unit/test_trl_training_args.py
    assert set(MAPPING) | refused == keys, (keys - set(MAPPING) - refused, (set(MAPPING) | refused) - keys)
    text = DOCS.read_text()
    missing = [k for k in keys if f"`{k}`" not in text]
    assert not missing, f"docs/trl.md does not mention {missing}"
    assert LazyGRPOConfig is GRPOConfig  # `from tidal import GRPOConfig`


ALTERNATIVES: dict[str, Any] = {
    "output_dir": "elsewhere", "num_generations": 4, "max_completion_length": 100, "max_prompt_length": 100,
    "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
    "generation_batch_size": 16, "steps_per_generation": 2, "chat_template_kwargs": {"enable_thinking": False},
    "chat_template_path": "{{ messages[0].content }}",
    "per_device_train_batch_size": 16, "gradient_accumulation_steps": 2, "learning_rate": 1e-5,
    "lr_scheduler_type": "cosine", "warmup_steps": 3, "warmup_ratio": 0.5, "weight_decay": 0.1, "adam_beta1": 0.8,
    "adam_beta2": 0.99,
    "max_grad_norm": 0.5, "optim": "adamw_8bit", "gradient_checkpointing": False, "bf16": False, "seed": 7,
    "trust_remote_code": True,
    "max_steps": 5, "num_train_epochs": 1.0, "beta": 0.04, "epsilon": 0.1, "epsilon_high": 0.28, "delta": 2.0,
    "loss_type": "grpo", "scale_rewards": False, "importance_sampling_level": "sequence", "num_iterations": 2,
    "mask_truncated_completions": True, "top_entropy_quantile": 0.2,
    "use_vllm": True, "vllm_importance_sampling_correction": False, "vllm_importance_sampling_cap": 2.5,
    "vllm_importance_sampling_mode": "token_mask", "vllm_importance_sampling_clip_max": 2.0,
    "vllm_server_host": "127.0.0.2", "vllm_server_port": 8123, "vllm_gpu_memory_utilization": 0.3,
    "vllm_tensor_parallel_size": 2, "vllm_max_model_length": 2048, "logging_steps": 1, "save_strategy": "no",
    "save_steps": 2, "save_total_limit": 2, "report_to": "tensorboard", "log_completions": True,
    # issue 51: TRL 1.16's loss / importance-sampling keys and the algorithm's inherited keys
    "sapo_temperature_neg": 2.0, "sapo_temperature_pos": 0.5, "vespo_k_pos": 1.0, "vespo_lambda_pos": 1.0,
    "vespo_k_neg": 1.0, "vespo_lambda_neg": 1.0, "vllm_importance_sampling_clip_min": 0.5,
    "off_policy_mask_threshold": 0.5, "use_bias_correction_kl": False, "adam_epsilon": 1e-6,
    "torch_compile": True, "use_liger_kernel": True, "entropy_coef": 0.01, "disable_dropout": True,
    "use_adaptive_entropy": True, "entropy_coef_min": 0.001, "entropy_coef_max": 0.5, "entropy_coef_delta": 0.01,
    "entropy_target": 0.5, "multi_objective_aggregation": "normalize_then_sum",
    "lr_scheduler_kwargs": {"num_cycles": 1.5}, "sync_ref_model": True, "ref_model_mixup_alpha": 0.9,
    "ref_model_sync_steps": 4,
}
"""A non-default value per mapped key whose effect shows in the derived configs (`NOT_IN_CONFIGS`: elsewhere)."""
WITH: dict[str, dict[str, Any]] = {
    "sapo_temperature_neg": {"loss_type": "sapo"}, "sapo_temperature_pos": {"loss_type": "sapo"},
    **dict.fromkeys(("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
                    {"loss_type": "vespo"}),
    "use_bias_correction_kl": {"beta": 0.1},
    **dict.fromkeys(("vllm_importance_sampling_correction", "vllm_importance_sampling_cap",
                     "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
                     "vllm_importance_sampling_clip_min"), {"use_vllm": True}),
    "lr_scheduler_kwargs": {"lr_scheduler_type": "cosine"}, "sync_ref_model": {"beta": 0.1},
    **dict.fromkeys(("ref_model_mixup_alpha", "ref_model_sync_steps"), {"beta": 0.1, "sync_ref_model": True}),
    **dict.fromkeys(("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target"),
                    {"use_adaptive_entropy": True})}
"""Keys whose effect needs another key set (the loss type that reads them, a KL term)."""
NOT_IN_CONFIGS = {"gradient_checkpointing_kwargs": "one value only: tidal's non-reentrant checkpointing",
                  "reward_weights": "the weights of the in-process reward functions (tests/unit/test_api.py)",
                  "vllm_mode": "one layout either way",
                  "vllm_server_timeout": "the launcher's wait (GRPOTrainer.train)",
                  "run_name": "tested with report_to", "eval_strategy": "tested with an eval dataset",
                  "eval_steps": "tested with an eval dataset", "num_generations_eval": "tested with an eval dataset",
                  "max_tool_calling_iterations": "the in-process tools' cap (tests/unit/test_api.py)"}


@pytest.mark.filterwarnings("ignore::tidal.config.base.ConfigWarning")  # sequence-level ratios with dapo
@pytest.mark.parametrize("key", sorted(set(MAPPING) - set(NOT_IN_CONFIGS)))
def test_each_mapped_key_changes_the_derived_configs(key):
    base = {"num_train_epochs": 2.0} if key == "num_train_epochs" else dict(WITH.get(key, {}))
    if key == "log_completions":
        base["report_to"] = "tensorboard"
    before = dump(derive(**base))
    after = dump(derive(**{**base, key: ALTERNATIVES[key]}))
    assert before != after, f"{key} has no effect"


def test_keys_outside_the_configs_are_mapped_keys():
    assert set(NOT_IN_CONFIGS) <= set(MAPPING)


def test_defaults_follow_trl():
    d = derive(n_rows=10)
    o, t = d.orch, d.train
    assert o.rollouts_per_example == 8 and o.batch_size == 8 and o.sampling.max_tokens == 512
    assert o.seq_len == 512 + 512 and o.long_prompts == "truncate" and d.infer.max_model_len == 1024
    assert o.sampling.top_k == -1 and t.gradient_checkpointing and t.recipe == "bf16"
    assert o.advantage.scale_rewards == "group" and o.env[0].id == "dataset" and o.report_to is None
    assert o.max_steps == 30  # 3 epochs x 10 prompts x 8 generations / 8 completions per batch
    assert t.loss.loss_type == "dapo" and t.loss.beta == 0 and t.loss.epsilon == 0.2
    assert t.loss.is_correction == "none"  # TRL 1.16 corrects with use_vllm only (default False)
    vllm = derive(use_vllm=True).train.loss
    assert vllm.is_correction == "sequence_masked" and vllm.is_cap == 3.0  # TRL 1.16: sequence_mask, 3.0
    assert t.loss.is_cap_min is None and t.loss.off_policy_mask_threshold is None
    assert not t.loss.use_bias_correction_kl  # TRL's True acts on the KL term, and beta is 0
    assert derive(beta=0.1).train.loss.use_bias_correction_kl
    assert t.loss.token_mask_high == t.loss.geo_mask_high == t.loss.sequence_mask_high == float("inf")
    assert t.loss.token_mask_low == t.loss.geo_mask_low == t.loss.sequence_mask_low == 0  # TRL has no such masks
    assert t.adam_epsilon == 1e-8 and not t.compile_layers and t.liger_kernel == []
    assert t.learning_rate == 1e-6 and t.lr_scheduler_type == "linear" and t.steps_per_generation == 1
    assert not t.lora  # no peft_config: full fine-tuning, as in TRL
    assert o.ckpt.interval == t.ckpt.interval == 500 and t.logging_steps == 10


def test_trl_batch_arithmetic_becomes_batches():
    # 4 completions per micro-batch, 8 micro-batches per generation, 2 per optimizer step: 4 optimizer steps per
    # generation of 32 completions (4 prompts x 8), each generation used twice (num_iterations)
    d = derive(per_device_train_batch_size=4, steps_per_generation=8, gradient_accumulation_steps=2,
               num_iterations=2, max_steps=20, save_steps=16, logging_steps=8)
    assert d.orch.batch_size == 32 and d.train.steps_per_generation == 4 and d.train.loss.num_iterations == 2
    assert d.orch.max_steps == 3  # ceil(20 / (4 x 2))
    assert d.orch.ckpt.interval == d.train.ckpt.interval == 2 and d.train.logging_steps == 1
    same = derive(per_device_train_batch_size=4, generation_batch_size=32, gradient_accumulation_steps=2)
    assert same.orch.batch_size == 32 and same.train.steps_per_generation == 4


@pytest.mark.parametrize(("kw", "match"), [
    ({"generation_batch_size": 16, "steps_per_generation": 2}, "not both"),
    ({"generation_batch_size": 12}, r"multiple of per_device_train_batch_size \(8\)"),
    ({"steps_per_generation": 3, "gradient_accumulation_steps": 2}, "multiple of gradient_accumulation_steps"),
    ({"per_device_train_batch_size": 6}, r"must be a multiple of num_generations \(8\)"),
    ({"report_to": "mlflow"}, "report_to 'mlflow' is not supported"),
    ({"run_name": "x"}, "run_name needs a report_to sink"),
    ({"log_completions": True}, "log_completions needs a report_to sink"),
    ({"eval_strategy": "steps"}, "needs an eval_dataset"),
    ({"eval_steps": 5}, "need eval_strategy='steps'"),
    ({"max_prompt_length": None}, "needs a length bound"),
    ({"reward_weights": [1.0, 2.0]}, r"2 weights for 1 reward functions"),
])
def test_impossible_combinations_name_the_keys(kw, match):
    with pytest.raises(ValueError, match=match):
        derive(**kw)


def test_unimplemented_and_unknown_keys_are_errors_naming_them():
    with pytest.raises(ValidationError, match=r"key 'fp16' is not supported yet by tidal"):
        GRPOConfig(fp16=True)
    with pytest.raises(ValidationError, match=r"sync_ref_model=True needs beta > 0"):
        GRPOConfig(sync_ref_model=True)
    with pytest.raises(ValidationError, match=r"ref_model_sync_steps applies with sync_ref_model=True only"):
        GRPOConfig(beta=0.1, ref_model_sync_steps=8)
    with pytest.raises(ValueError, match=r"sync_ref_model needs full fine-tuning"):  # TRL refuses PEFT too
        derive(peft=FakeLora(), beta=0.1, sync_ref_model=True)
    loss = derive(beta=0.1, sync_ref_model=True, ref_model_sync_steps=8).train.loss
    assert loss.sync_ref_model and loss.ref_model_sync_steps == 8 and loss.ref_model_mixup_alpha == 0.6
    # TRL checks vespo against the IS mode (default sequence_mask) and applies the correction with vLLM only
    with pytest.raises(ValidationError, match=r"'vespo' with use_vllm=True needs vllm_importance_sampling_mode"):
        GRPOConfig(loss_type="vespo", use_vllm=True)
    assert derive(loss_type="vespo").train.loss.is_correction == "none"
    assert derive(loss_type="vespo", use_vllm=True, vllm_importance_sampling_mode="token_mask"
                  ).train.loss.is_correction == "masked"
    with pytest.raises(ValidationError, match=r"set vllm_importance_sampling_clip_min or .*_truncate"):
        GRPOConfig(use_vllm=True, vllm_importance_sampling_mode="token_truncate",
                   vllm_importance_sampling_clip_max=None)
    with pytest.raises(ValidationError, match=r"clip_min \(3.0\) must be less than .*clip_max \(2.0\)"):
        GRPOConfig(use_vllm=True, vllm_importance_sampling_clip_min=3.0, vllm_importance_sampling_clip_max=2.0)
    with pytest.raises(ValidationError, match=r"gradient_checkpointing_kwargs .* non-reentrant"):
        GRPOConfig(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert derive(use_vllm=True, vllm_importance_sampling_clip_max=None).train.loss.is_cap == float("inf")
    assert GRPOConfig(use_vllm=True).use_vllm and not GRPOConfig().use_vllm  # tidal always uses vLLM
    assert derive().train.loss.is_correction == "none", "TRL corrects nothing without use_vllm"
    assert derive(use_vllm=True).train.loss.is_correction == "sequence_masked"
    with pytest.raises(ValidationError, match=r"'num_generation' is not a TRL GRPOConfig key.*'num_generations'"):
        GRPOConfig(num_generation=4)
    with pytest.raises(ValidationError, match="loss_type"):
        GRPOConfig(loss_type="gspo")
    for loss_type in ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo"):  # TRL 1.16's (vespo above)
        assert derive(loss_type=loss_type).train.loss.loss_type == loss_type
    assert GRPOConfig(fp16=False, shuffle_dataset=True).fp16 is False  # TRL's defaults are accepted
    assert GRPOConfig("out").output_dir == "out"  # positional output_dir, as TRL


def test_normalize_then_sum_reaches_the_orchestrator_and_drops_scale_rewards():
    """GDPO normalizes per group and then over the batch whatever `scale_rewards` says (TRL 1.16's code)."""
    adv = derive(multi_objective_aggregation="normalize_then_sum", scale_rewards="batch").orch.advantage
    assert adv.multi_objective_aggregation == "normalize_then_sum" and adv.scale_rewards == "none"
    assert derive(scale_rewards="batch").orch.advantage.multi_objective_aggregation == "sum_then_normalize"
    with pytest.raises(ValidationError, match="multi_objective_aggregation"):
        GRPOConfig(multi_objective_aggregation="sum")


def test_lr_scheduler_kwargs_num_cycles_shapes_the_cosine_and_other_knobs_are_refused():
    """transformers' cosine with `num_cycles` (float64 reference of its formula); keys tidal's schedule lacks
    (`min_lr`, anything with linear) are refused at construction, naming the key."""
    d = derive(max_steps=20, lr_scheduler_type="cosine", warmup_steps=4, lr_scheduler_kwargs={"num_cycles": 1.5})
    assert d.train.lr_cosine_cycles == 1.5
    lrs = schedule(d)
    expect = [max(0.0, 0.5 * (1 + math.cos(math.pi * 2 * 1.5 * (s - 4) / 16))) for s in range(4, 20)]
    assert lrs[4:] == pytest.approx(expect, rel=1e-12, abs=1e-15)
    assert min(lrs[4:12]) < 0.05 and max(lrs[12:]) > 0.9, "down to ~0 and back up: a second wave"
    with pytest.raises(ValidationError, match=r"lr_scheduler_kwargs \['min_lr'\] have no knob .*'cosine'"):
        GRPOConfig(lr_scheduler_type="cosine", lr_scheduler_kwargs={"min_lr": 1e-6})
    with pytest.raises(ValidationError, match=r"lr_scheduler_kwargs \['num_cycles'\] have no knob .*'linear'"):
        GRPOConfig(lr_scheduler_kwargs={"num_cycles": 2})
    with pytest.raises(ValidationError, match="lr_cosine_cycles applies with lr_scheduler_type 'cosine' only"):
        TrainConfig(model="m", lr_cosine_cycles=1.0)


def test_report_to_and_eval():
    d = derive(report_to=["wandb"], run_name="r1", log_completions=True)
    assert d.orch.report_to is not None and d.orch.report_to.wandb and not d.orch.report_to.tensorboard
    assert d.orch.report_to.name == "r1" and d.orch.report_to.samples is True
    ev = derive(eval_=True, eval_strategy="steps", eval_steps=4, num_generations_eval=2).orch.eval
    default = derive(eval_=True, eval_strategy="steps").orch.eval
    assert default is not None and default.rollouts_per_example == 8 and default.interval == 10  # logging_steps
    assert ev is not None and ev.interval == 4 and ev.rollouts_per_example == 2 and ev.env[0].id == "dataset"


@dataclass
class FakeLora:
    """What tidal reads of a peft.LoraConfig (duck-typed: the config layer never imports peft)."""

    r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    target_modules: Any = field(default_factory=lambda: {"q_proj", "v_proj"})
    bias: str = "none"
    use_dora: bool = False


def test_peft_config_maps_to_lora_keys():
    t = derive(peft=FakeLora()).train
    assert (t.lora_rank, t.lora_alpha, t.lora_dropout, t.lora_target_modules) == (8, 16, 0.05, ["q_proj", "v_proj"])
    assert derive(peft=FakeLora(target_modules="all-linear")).train.lora_target_modules == "all-linear"
    with pytest.raises(ValueError, match=r"peft_config.use_dora = True is not supported"):
        derive(peft=FakeLora(use_dora=True))


def test_a_real_peft_lora_config_maps():
    peft = pytest.importorskip("peft")
    t = derive(peft=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], task_type="CAUSAL_LM")).train
    assert (t.lora_rank, t.lora_alpha, t.lora_target_modules) == (4, 8, ["q_proj"])


def schedule(d: Any) -> list[float]:
    """The LR factor of every optimizer step of the derived run: the train config as `tidal grpo` wires it (train
    `max_steps` from orch), through the trainer's schedule (`lr_factor` at batch + k / K, `tidal.trainer.grpo`)."""
    from tidal.colocate.derive import wire_colocate
    from tidal.trainer.step.optim import lr_factor

    train, _, _ = wire_colocate(d.train, d.infer, d.orch)
    k = d.optimizer_steps_per_batch * train.loss.num_iterations
    return [lr_factor(b + i / k, train.lr_scheduler_type, train.warmup_steps, train.max_steps, train.lr_cosine_cycles)
            for b in range(train.max_steps) for i in range(k)]


def test_warmup_ratio_is_a_share_of_the_runs_optimizer_steps():
    # TRL's defaults: one optimizer step per batch; ceil(0.1 x 25) = 3 warmup steps (transformers' get_warmup_steps)
    d = derive(warmup_ratio=0.1, max_steps=25, lr_scheduler_type="cosine")
    assert d.orch.max_steps == 25 and d.train.warmup_steps == 3
    lrs = schedule(d)
    assert len(lrs) == 25 and all(f < 1 for f in lrs[:3]) and lrs[3] == 1.0 and lrs[:4] == sorted(lrs[:4])
    assert lrs[4:] == sorted(lrs[4:], reverse=True) and lrs[-1] < 0.01  # cosine to ~0 over the run
    # 4 optimizer steps per batch: 40 optimizer steps = 10 batches; ceil(0.1 x 40) = 4 optimizer steps = 1 batch
    d = derive(warmup_ratio=0.1, max_steps=40, per_device_train_batch_size=4, steps_per_generation=8,
               gradient_accumulation_steps=2, lr_scheduler_type="cosine")
    assert d.orch.max_steps == 10 and d.optimizer_steps_per_batch == 4 and d.train.warmup_steps == 1
    lrs = schedule(d)
    assert len(lrs) == 40 and all(f < 1 for f in lrs[:4]) and lrs[4] == 1.0 and lrs[-1] < 0.02
    assert derive(warmup_ratio=0.0).train.warmup_steps == 0


def test_warmup_steps_count_optimizer_steps_and_below_1_are_a_ratio():
    four = {"per_device_train_batch_size": 4, "steps_per_generation": 8, "gradient_accumulation_steps": 2,
            "max_steps": 40}  # 4 optimizer steps per batch, 10 batches
    assert derive(warmup_steps=8, **four).train.warmup_steps == 2  # 8 optimizer steps = 2 batches
    assert derive(warmup_steps=5, **four).train.warmup_steps == 2  # rounded up to whole batches
    assert derive(warmup_steps=0.25, **four).train.warmup_steps == 3  # transformers 5: ceil(0.25 x 40) = 10 -> 3
    assert derive(warmup_steps=10, warmup_ratio=0.25, **four).train.warmup_steps == 3  # both say 10: fine
    with pytest.raises(ValueError, match=r"warmup_steps 4 \(4 optimizer steps\) and warmup_ratio 0.25 \(10 of the "
                                         r"run's 40\) disagree"):
        derive(warmup_steps=4, warmup_ratio=0.25, **four)
    with pytest.raises(ValueError, match=r"warmup_steps 2.5: give a whole number of optimizer steps, or a ratio"):
        derive(warmup_steps=2.5)
    with pytest.raises(ValidationError, match="warmup_ratio"):
        GRPOConfig(warmup_ratio=1.5)


def test_a_usual_trl_script_builds():
    """A TRL user's GRPO script (warmup_ratio, cosine, save_steps, report_to none, dr_grpo, two reward functions,
    a LoRA peft_config) maps as written, with warmup_ratio 0.1 and 0."""
    for ratio in (0.1, 0.0):
        args = GRPOConfig(output_dir="outputs/trl", learning_rate=5e-6, adam_beta1=0.9, adam_beta2=0.99,
                          weight_decay=0.1, warmup_ratio=ratio, lr_scheduler_type="cosine", optim="adamw_torch_fused",
                          logging_steps=1, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                          num_generations=8, max_prompt_length=256, max_completion_length=200, max_steps=250,
                          save_steps=250, max_grad_norm=0.1, report_to="none", loss_type="dr_grpo", bf16=True)
        d = to_tidal(args, "tidal:tiny-reverse", 100, 2, FakeLora())
        t = d.train
        assert t.warmup_steps == (25 if ratio else 0) and t.lr_scheduler_type == "cosine" and t.lora
        assert t.loss.loss_type == "dr_grpo" and d.orch.ckpt.interval == t.ckpt.interval == 250
        assert d.orch.report_to is None and d.orch.max_steps == 250


def test_resume_from_checkpoint_is_an_argument_of_train_not_a_config_key():
    with pytest.raises(ValidationError, match=r"resume_from_checkpoint' is not read by the trainer .*trainer.train\("
                                              r"resume_from_checkpoint=...\)"):
        GRPOConfig(resume_from_checkpoint="outputs/checkpoint-500")
    assert GRPOConfig(resume_from_checkpoint=None).resume_from_checkpoint is None


def test_importance_sampling_bounds_as_trl_allows_them():
    """TRL 1.16 takes any positive clip_max (below 1 too) and a clip_min alone; they reach train loss.is_cap /
    is_cap_min as given."""
    low = derive(use_vllm=True, vllm_importance_sampling_mode="token_truncate",
                 vllm_importance_sampling_clip_max=0.8).train.loss
    assert low.is_correction == "truncated" and low.is_cap == 0.8 and low.is_cap_min is None
    only_min = derive(use_vllm=True, vllm_importance_sampling_mode="sequence_truncate",
                      vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=None).train.loss
    assert only_min.is_correction == "sequence_truncated" and only_min.is_cap_min == 0.5
    assert only_min.is_cap == float("inf")


def test_refusal_texts_of_compile_and_liger_name_the_keys_that_map_them():
    """torch_compile and use_liger_kernel are mapped (train compile_layers / liger_kernel): the refusals of their
    sub-options say so, instead of claiming tidal does not compile or has no Liger kernels."""
    fields = TrainingArgumentsFields.model_fields
    for key, mapped in (("torch_compile_backend", "compile_layers"), ("torch_compile_mode", "compile_layers"),
                        ("liger_kernel_config", "liger_kernel")):
        doc = fields[key].description or ""
        assert mapped in doc and "is refused" not in doc and "does not torch.compile" not in doc, (key, doc)
    docs = DOCS.read_text()
    assert "use_liger_kernel is refused" not in docs and "does not torch.compile" not in docs


@pytest.mark.parametrize("kw", [{}, {"use_vllm": True, "vllm_importance_sampling_correction": False},
                                {"use_vllm": True}])
def test_grpo_config_derived_for_a_gpu_never_lags_without_a_correction(kw):
    """Issue 66: tidal samples with vLLM, and on a GPU `tidal grpo`'s default is one policy of lag; TRL's default
    (`use_vllm=False`) corrects nothing because TRL samples on-policy. Derived for a simulated GPU machine, a
    GRPOConfig either samples on-policy (orch and train max_async_level 0) or corrects the ratio."""
    from tidal.colocate.derive import Machine, derive_colocate

    d = derive(**kw)
    for machine in (Machine(cores=tuple(range(16)), has_gpu=True, gpu_memory_gib=80.0), Machine(cores=(0, 1))):
        co = derive_colocate(d.train, d.infer, d.orch, machine)
        corrected = co.train.loss.is_correction != "none"
        on_policy = co.orch.max_async_level == 0 and co.train.max_async_level == 0
        assert corrected or on_policy, (kw, machine.has_gpu, co.orch.max_async_level, co.train.loss.is_correction)
        assert corrected == bool(kw.get("use_vllm") and kw.get("vllm_importance_sampling_correction", True))


@pytest.mark.parametrize(("key", "value"), [("vllm_importance_sampling_correction", False),
                                            ("vllm_importance_sampling_mode", "token_mask"),
                                            ("vllm_importance_sampling_clip_max", 2.0),
                                            ("vllm_importance_sampling_clip_min", 0.5),
                                            ("vllm_importance_sampling_cap", 2.5)])
def test_importance_sampling_keys_without_use_vllm_are_refused_not_ignored(key, value):
    """Issue 66: TRL reads the vLLM IS keys with use_vllm=True only; without it they changed nothing in tidal
    either (train loss.is_correction stayed `none`). Set away from their default, they are refused naming the key;
    at their default (as a TRL script may spell them out) they are accepted."""
    with pytest.raises(ValidationError, match=rf"GRPOConfig {key} applies with use_vllm=True only"):
        GRPOConfig(**{key: value})
    default = GRPOConfig.model_fields[key].default
    assert GRPOConfig(**{key: default}).corrects_is() is False
    assert derive(use_vllm=True, **{key: value, **({"vllm_importance_sampling_clip_max": 2.0}
                                                    if key == "vllm_importance_sampling_clip_min" else {})})


def test_vespo_runs_with_the_correction_off_as_its_refusal_suggests():
    """Issue 66 (TRL 1.16 checks vespo's IS mode only with use_vllm and vllm_importance_sampling_correction): the
    setting vespo's refusal names, vllm_importance_sampling_correction=False, runs (uncorrected, hence on-policy)."""
    with pytest.raises(ValidationError, match=r"or vllm_importance_sampling_correction=False"):
        GRPOConfig(loss_type="vespo", use_vllm=True)
    d = derive(loss_type="vespo", use_vllm=True, vllm_importance_sampling_correction=False)
    assert d.train.loss.loss_type == "vespo" and d.train.loss.is_correction == "none"
    assert d.orch.max_async_level == 0 and d.train.max_async_level == 0
