"""Each LoRA policy's merged copy holds only the weights LoRA changes (`changed_keys`, `grpo.slim_reloads`): W + s B A
for every adapted module, exactly, and nothing else (the embeddings and norms stay as vLLM loaded them); fully
fine-tuned, QLoRA and QeRL policies keep every tensor. Random-init models of two architectures."""

from __future__ import annotations

import pytest
import torch

from tidal.config.train import TrainConfig
from tidal.trainer.grpo import slim_reloads
from tidal.trainer.publish.broadcast import changed_keys, merged_state_dict, publish_adapter


def tiny(kind: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}
    return LlamaForCausalLM(LlamaConfig(**common)) if kind == "llama" else Qwen3ForCausalLM(Qwen3Config(
        **common, head_dim=8))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_the_merged_copy_holds_exactly_the_adapted_weights(tmp_path, kind):
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    torch.manual_seed(0)
    base = tiny(kind)
    keys = sorted(k for k in base.state_dict() if k != "lm_head.weight")  # a tied checkpoint's tensors
    reference = {k: v.clone().double() for k, v in base.state_dict().items()}
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    slim = changed_keys(model, keys)
    assert slim and set(slim) < set(keys)
    assert all(k.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight")) for k in slim)
    assert "model.embed_tokens.weight" not in slim and not any("norm" in k for k in slim)
    publish_adapter(model, tmp_path, 1, merged_keys=slim)
    written = load_file(str(tmp_path / "broadcasts" / "step_1" / "merged" / "model.safetensors"))
    assert sorted(written) == slim
    full = merged_state_dict(model, keys)
    for k in slim:  # W + s B A, against a float64 reference built from the PEFT layer's own factors
        module = model.get_submodule("base_model.model." + k.removesuffix(".weight"))
        a, b = module.lora_A["default"].weight.double(), module.lora_B["default"].weight.double()
        want = reference[k] + module.scaling["default"] * b @ a
        assert torch.allclose(written[k].double(), want, atol=1e-6) and torch.equal(written[k], full[k])
    for k in set(keys) - set(slim):  # what is left out is what LoRA did not change
        assert torch.equal(full[k].double(), reference[k])


def test_only_plain_lora_policies_publish_the_slim_copy():
    assert slim_reloads(TrainConfig(model="m"))
    assert not slim_reloads(TrainConfig(model="m", lora=False))
    assert not slim_reloads(TrainConfig(model="m", noise_scheduler={"enabled": True}))
    assert changed_keys(tiny("llama"), ["a", "b"]) == ["a", "b"]  # not PEFT: every tensor
