"""The trainer's footprint estimate (`tidal.models.memory`) and the co-locate GPU split it drives: parameter
counts against real models built from configs, the parts' behaviour, and vLLM's share of the GPU."""

from __future__ import annotations

import pytest
import torch

from tidal.config import TrainConfig
from tidal.models.memory import GIB, estimate, lora_parameter_count, parameter_count

QWEN3 = {"model_type": "qwen3", "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 300,
         "tie_word_embeddings": True}
LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 192, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 500, "tie_word_embeddings": False}
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 48,
             "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 200, "tie_word_embeddings": False}
QWEN3_0_6B = {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
              "num_attention_heads": 16,
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


def test_tidal_grpo_estimates_from_the_model_directory():
    from tidal.models.memory import train_footprint_gib

    base = TrainConfig(model="tidal:tiny-reverse", sequence_len=4096, per_device_train_batch_size=8,
                       gradient_checkpointing=False)
    gib = train_footprint_gib(base)
    assert 1.0 < gib < 6.0  # a 13 MB model: the CUDA overhead and the (8, 1, T, T) mask dominate
    assert train_footprint_gib(base.model_copy(update={"gradient_checkpointing": True})) < gib
    assert train_footprint_gib(base.model_copy(update={"logprob_chunk_size": 0})) > gib


LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}
QWEN3_4B = {"model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "tie_word_embeddings": True}
H100_PEAKS = [  # (config, tokens in one row, checkpointing, base, torch.cuda.max_memory_allocated GiB)
    (QWEN3_0_6B, 16384, True, None, 4.77),
    (QWEN3_0_6B, 16384, False, None, 57.2),
    (QWEN3_4B, 16384, True, None, 16.26),
    (LLAMA_8B, 20480, True, None, 28.56),
    (LLAMA_8B, 65536, True, None, 57.3),
    (LLAMA_8B, 20480, True, "nf4", 20.4),
]
"""Peaks of bench/gpu_trainer.py's training step (LoRA r16 all-linear, bf16, chunked logprobs, SDPA with the packed
rows' dense mask) on an H100, issue 26 item 3 (2026-11-24)."""


@pytest.mark.parametrize(("cfg", "tokens", "ckpt", "base", "measured"), H100_PEAKS,
                         ids=["0.6b-16k-ckpt", "0.6b-16k", "4b-16k-ckpt", "8b-20k-ckpt", "8b-65k-ckpt", "8b-nf4-20k"])
def test_the_estimate_is_within_15_percent_of_every_measured_h100_peak(cfg, tokens, ckpt, base, measured):
    f = estimate(cfg, rows=1, sequence_len=tokens, gradient_checkpointing=ckpt, base=base)
    assert f.allocated / GIB == pytest.approx(measured, rel=0.15)
    assert f.total > f.allocated  # the share adds the CUDA overhead and the margin


def test_the_per_layer_term_is_what_autograd_saves_on_a_real_qwen3_layer():
    """Count the bytes autograd keeps for the backward (saved_tensors_hooks, unique storages, parameters left out)
    of a 1- and a 2-layer Qwen3 with tidal's LoRA, in bf16 on CPU (no mask: a single sample; SDPA's flash path
    keeps q, k, v, out as on the GPU): the difference per token is one layer's term."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tidal.models.memory import layer_bytes_per_token
    from tidal.trainer.model.load import add_lora

    shape = {"hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 64, "vocab_size": 300, "tie_word_embeddings": True}
    tokens = 64

    def saved_bytes(layers: int) -> int:
        torch.manual_seed(0)
        with torch.device("cpu"):
            model = Qwen3ForCausalLM(Qwen3Config(**shape, num_hidden_layers=layers, attn_implementation="sdpa"))
        model = add_lora(model.to(torch.bfloat16), TrainConfig(model="x", lora_rank=8, lora_alpha=16)).train()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                seen[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=torch.randint(0, 300, (1, tokens)), use_cache=False)
        return sum(seen.values())

    per_token = (saved_bytes(2) - saved_bytes(1)) / tokens
    targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    model_config = {**shape, "model_type": "qwen3", "num_hidden_layers": 2}
    predicted = layer_bytes_per_token(model_config, 2, targets, dense_mask=False)
    assert predicted == pytest.approx(per_token, rel=0.05), (predicted, per_token)


def test_selective_checkpointing_and_offload_sit_between_full_checkpointing_and_none():
    """The activation policy's keys (`tidal.trainer.model.activations`) change the estimate the split uses: every k-th
    layer checkpointed keeps the others' full set; offload keeps one layer's set on the device."""
    def act(**kw):
        return estimate(QWEN3_0_6B, rows=1, sequence_len=4096, dense_mask=False, **kw).activations

    every, none = act(gradient_checkpointing=True), act()
    two, four = act(gradient_checkpointing=True, checkpoint_every=2), act(gradient_checkpointing=True,
                                                                         checkpoint_every=4)
    assert every < two < four < none
    # 28 layers, every 2nd checkpointed: 14 keep their full set
    per_layer = (none - 0) / 28
    assert two == pytest.approx(every + 14 * per_layer - 14 * 4096 * 1024 * 2, rel=1e-9)
    assert act(gradient_checkpointing=True, checkpoint_scope="mlp") >= none  # an upper bound, by design
    assert act(offload_activations=True) < every  # nothing kept but the layer in flight
    assert act(gradient_checkpointing=True, checkpoint_every=2, offload_activations=True) < two


def test_the_trainer_estimate_drops_the_dense_mask_unless_attention_is_dense():
    from tidal.models.memory import train_estimate

    flex = train_estimate(TrainConfig(model="tidal:tiny-reverse", sequence_len=1024), gradient_checkpointing=False)
    dense = train_estimate(TrainConfig(model="tidal:tiny-reverse", sequence_len=1024, attention="dense"),
                           gradient_checkpointing=False)
    assert dense.activations > flex.activations
