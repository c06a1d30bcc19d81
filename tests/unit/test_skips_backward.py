"""`tidal.models.arch.skips_backward` (train `skip_zero_gradient`'s model rule, moved out of the recipe): dense text
models may skip, mixture-of-experts models (every expert key transformers writes, a VLM's `text_config` too) and
batches with images may not. Configs built by transformers from their defaults (no download)."""

from __future__ import annotations

import pytest

from tidal.models.arch import EXPERT_KEYS, is_moe, skips_backward


@pytest.mark.parametrize("model_type, moe", [("qwen3", False), ("llama", False), ("qwen3_moe", True),
                                             ("mixtral", True), ("deepseek_v3", True), ("qwen2_5_vl", False)])
def test_the_rule_follows_the_models_config(model_type, moe):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type).to_dict()
    assert is_moe(config) is moe and skips_backward(config, images=False) is (not moe)
    assert not skips_backward(config, images=True), "an image batch's vision tower may get no gradient"


@pytest.mark.parametrize("key", EXPERT_KEYS)
def test_every_expert_key_counts_at_top_level_and_in_a_text_config(key):
    assert not skips_backward({key: 8}, images=False)
    assert not skips_backward({"model_type": "vlm", "text_config": {key: 4}}, images=False)
    assert skips_backward({key: 0}, images=False) and skips_backward({key: None}, images=False)
