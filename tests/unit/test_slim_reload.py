"""Each LoRA policy's merged copy holds only the weights LoRA changes (`changed_keys`, `grpo.slim_reloads`): W + s B A
for every adapted module, exactly, and nothing else (the embeddings and norms stay as vLLM loaded them); fully
fine-tuned, QLoRA and QeRL policies keep every tensor. Random-init models of two architectures; and the models whose
weights transformers 5 renames at load (Qwen2.5-VL, the Llava-mapped Llava and Gemma 3 VLMs: `model.language_model.*`
in the trainer, `model.*` / `language_model.model.*` in the checkpoint), whose merged copy was empty before the names
went through `checkpoint_tensors` (issue 66), plus every text architecture of the test matrix."""

from __future__ import annotations

import pytest
import torch

from tests.archs import ARCHS
from tidal.config.train import TrainConfig
from tidal.trainer.grpo import slim_reloads
from tidal.trainer.publish.broadcast import (
    SlimReloadError,
    changed_keys,
    checkpoint_keys,
    lora_layers,
    merged_state_dict,
    policy_weight_specs,
    publish_adapter,
)


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


TEXT = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
          "image_size": 16, "patch_size": 8}


def renamed(kind: str, out) -> torch.nn.Module:
    """A random-init VLM whose checkpoint names differ from its parameter names, saved to `out` as transformers
    saves it (the Hub's names: `save_pretrained` reverts the load-time renaming)."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    if kind == "qwen2_5_vl":
        from tests.tiny_qwen_vl import build_tiny_qwen_vl
        from tidal.trainer.model.load import load_base_model

        build_tiny_qwen_vl(out, "qwen2_5_vl")
        return load_base_model(str(out), torch.device("cpu"), torch.float32)
    if kind == "llava":
        model = LlavaForConditionalGeneration(LlavaConfig(
            text_config={"model_type": "llama", **TEXT}, image_token_id=100,
            vision_config={"model_type": "clip_vision_model", "projection_dim": 32, **VISION}))
    else:
        model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=TEXT, vision_config=VISION,
                                                            mm_tokens_per_image=4, image_token_index=100))
    model.save_pretrained(out)
    return model


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "llava", "gemma3"])
def test_renamed_weights_publish_their_adapted_tensors(tmp_path, kind):
    """The trainer's `model.language_model.layers.0.self_attn.q_proj` is the checkpoint's
    `model.layers.0...` (Qwen2.5-VL) or `language_model.model.layers.0...` (Llava, Gemma 3): the slim copy holds
    the checkpoint's names of every adapted module, W + s B A under each, and loads into a fresh model as the
    merged policy. Before the fix the intersection was empty: an empty `merged/model.safetensors`."""
    from safetensors.torch import load_file

    from tidal.trainer.model.load import add_lora

    torch.manual_seed(0)
    base = renamed(kind, tmp_path / "model")
    keys = checkpoint_keys(tmp_path / "model")
    model = add_lora(base, TrainConfig(model=str(tmp_path / "model"), lora_rank=4))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    old = [k for k in keys if k in {key for key, _ in lora_layers(model)}]
    assert old == []  # the names the old code intersected: none (what made every merged copy empty)
    slim = changed_keys(model, keys)
    specs = {name: shape for name, _, shape in policy_weight_specs(model)}
    assert sorted(slim) == sorted(specs) and len(slim) == 2 * 7  # 2 layers x q k v o gate up down
    assert all(not k.startswith("model.language_model.") for k in slim)
    assert not any("vision" in k or "embed" in k or "norm" in k for k in slim)
    publish_adapter(model, tmp_path / "run", 1, merged_keys=slim)
    written = load_file(str(tmp_path / "run" / "broadcasts" / "step_1" / "merged" / "model.safetensors"))
    assert sorted(written) == sorted(slim)
    for name, module in model.named_modules():  # W + s B A in float64, under the checkpoint's name
        if not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        ckpt = [k for k, _, _ in policy_weight_specs_of(model, name)]
        a, b = module.lora_A["default"].weight.double(), module.lora_B["default"].weight.double()
        want = module.get_base_layer().weight.double() + module.scaling["default"] * b @ a
        assert torch.allclose(written[ckpt[0]].double(), want, atol=1e-6)


def policy_weight_specs_of(model, module_name: str):
    """The checkpoint name(s) `policy_weight_specs` gives one module's weight."""
    from tidal.models.names import checkpoint_tensors, plain_name

    return [(n, None, None) for n, _ in checkpoint_tensors(
        model, [(plain_name(module_name) + ".weight", torch.empty(0))])]


def test_an_adapted_weight_missing_from_the_checkpoint_is_an_error():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny("llama"), LoraConfig(r=4, target_modules=["q_proj"]))
    keys = sorted(k for k in tiny("llama").state_dict() if k != "lm_head.weight")
    with pytest.raises(SlimReloadError, match="leave out 2 of its 2 adapted weights"):
        changed_keys(model, [k for k in keys if "q_proj" not in k])  # e.g. names of another layout: none found
    with pytest.raises(SlimReloadError, match="leave out 1 of its 2"):
        changed_keys(model, [k for k in keys if k != "model.layers.1.self_attn.q_proj.weight"])


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_matrix_architecture_has_a_slim_copy(arch):
    """The default all-linear LoRA of every architecture of the test matrix: its adapted weights are all found
    among the checkpoint's names (the experts of a mixture-of-experts model are not adapted)."""
    from transformers import AutoModelForCausalLM

    from tests.archs import config_for
    from tidal.models.names import base_weights
    from tidal.trainer.model.load import add_lora

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config_for(arch))
    keys = sorted(k for k, _ in base_weights(base))
    model = add_lora(base, TrainConfig(model="m", lora_rank=4))
    slim = changed_keys(model, keys)
    assert slim and len(slim) == len(policy_weight_specs(model))
