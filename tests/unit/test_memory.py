"""The trainer's footprint estimate (`tidal.trainer.memory`) and the co-locate GPU split it drives: parameter
counts against real models built from configs, the parts' behaviour, and vLLM's share of the GPU."""

from __future__ import annotations

import pytest
import torch

from tidal.config import ConfigError, InferConfig, OrchConfig, TrainConfig
from tidal.config.colocate import Machine, derive_colocate, vllm_share
from tidal.trainer.memory import GIB, estimate, lora_parameter_count, parameter_count

QWEN3 = {"model_type": "qwen3", "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 300,
         "tie_word_embeddings": True}
LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 192, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 500, "tie_word_embeddings": False}
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 48,
             "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 200, "tie_word_embeddings": False}
QWEN3_0_6B = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True}


def build(cfg: dict) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**cfg)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("cfg", [QWEN3, LLAMA, QWEN3_MOE], ids=["qwen3-tied", "llama-untied", "qwen3-moe"])
def test_parameter_counts_match_real_models(cfg):
    model = build(cfg)
    real = sum(p.numel() for p in model.parameters())
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert parameter_count(cfg) == real - norms, (parameter_count(cfg), real, norms)


@pytest.mark.parametrize("cfg", [QWEN3, LLAMA], ids=["qwen3", "llama"])
def test_lora_parameter_count_matches_peft(cfg):
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "v_proj", "down_proj"]
    model = get_peft_model(build(cfg), LoraConfig(r=8, target_modules=targets))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_parameter_count(cfg, 8, targets) == trainable


def test_the_estimate_behaves_like_the_trainer():
    base = estimate(QWEN3_0_6B, rows=1, sequence_len=4096)
    assert 0.5 * GIB < base.weights < 1.5 * GIB  # ~0.6B parameters in bf16
    checkpointed = estimate(QWEN3_0_6B, rows=1, sequence_len=4096, gradient_checkpointing=True)
    assert checkpointed.activations < base.activations / 5
    full_logits = estimate(QWEN3_0_6B, rows=1, sequence_len=4096, logprob_chunk_size=0)
    assert full_logits.logits > 6 * GIB and base.logits < full_logits.logits / 3  # ~6-10 GB vs chunk buffers
    small_chunks = estimate(QWEN3_0_6B, rows=1, sequence_len=4096, logprob_chunk_size=256)
    assert small_chunks.logits < GIB / 2
    assert estimate(QWEN3_0_6B, rows=2, sequence_len=4096).activations == 2 * base.activations
    full_ft = estimate(QWEN3_0_6B, lora_rank=None)
    assert full_ft.lora > 5 * full_ft.weights and base.lora < base.weights / 5
    assert base.total == int(sum((base.weights, base.lora, base.activations, base.logits, base.overhead)) * 1.1)


def test_vllm_gets_what_the_trainer_leaves_unless_infer_sets_it():
    assert vllm_share(80.0, 20.0) == 0.75 and vllm_share(80.0, 20.5) == 0.74
    with pytest.raises(ConfigError, match="needs about 78.0 GiB of this 80.0 GiB GPU"):
        vllm_share(80.0, 78.0)
    gpu = Machine(cores=tuple(range(16)), has_gpu=True, gpu_memory_gib=80.0)
    train, orch = TrainConfig(model="m"), OrchConfig()
    co = derive_colocate(train, InferConfig(model="m"), orch, gpu, trainer_gib=lambda t: 20.0)
    assert co.infer.gpu_memory_utilization == 0.75 and any("0.75" in n for n in co.placement.notices)
    explicit = InferConfig(model="m", gpu_memory_utilization=0.5)
    assert derive_colocate(train, explicit, orch, gpu, trainer_gib=lambda t: 20.0).infer.gpu_memory_utilization == 0.5
    seen = []
    derive_colocate(train, InferConfig(model="m"), OrchConfig.model_validate({"seq_len": 4096}), gpu,
                    trainer_gib=lambda t: seen.append(t.sequence_len) or 20.0)
    assert seen == [4096], "the estimate sees the derived train config (sequence_len follows orch seq_len)"
    cpu = Machine(cores=(0, 1))
    on_cpu = derive_colocate(train, InferConfig(model="m"), orch, cpu, trainer_gib=lambda t: 20.0)
    assert on_cpu.infer.gpu_memory_utilization == 0.9  # no GPU: vLLM's default, untouched


def test_tidal_grpo_estimates_from_the_model_directory():
    from tidal.cli import trainer_footprint_gib

    base = TrainConfig(model="tidal:tiny-reverse", sequence_len=4096, per_device_train_batch_size=8)
    gib = trainer_footprint_gib(base)
    assert 1.0 < gib < 3.0  # a 13 MB model: the CUDA overhead dominates
    assert trainer_footprint_gib(base.model_copy(update={"gradient_checkpointing": True})) < gib
    assert trainer_footprint_gib(base.model_copy(update={"logprob_chunk_size": 0})) > gib
