"""Rollout filters: gibberish and repetition flags from token ids and logprobs; `enforce` masks the loss."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tidal.config.orch import OrchConfig
from tidal.inference.protocol import Completion
from tidal.orchestrator.assemble import build_batch
from tidal.orchestrator.filters import Filters, model_vocab_size


def comp(ids, lps) -> Completion:
    return Completion(list(ids), [float(x) for x in lps], "", "stop")


def test_gibberish_flags_a_rare_token_at_near_uniform_probability():
    cfg = OrchConfig.model_validate({"filters": [{"type": "gibberish", "token_id_threshold": 100, "vocab_size": 1000,
                                                  "logprob_offset": 2.0}]})
    limit = -math.log(1000) + 2.0  # -4.91
    f = Filters(cfg.filters, cfg.model.name)
    cases = [comp([5, 150], [-0.1, limit - 0.5]),   # rare id, improbable: flagged
             comp([5, 150], [-0.1, limit + 0.5]),   # rare id but likely enough
             comp([5, 50], [-0.1, limit - 3.0]),    # improbable but a common id
             comp([], [])]
    masked, m = f.apply(cases)
    assert m["filters/gibberish/flagged"] == 0.25 and not masked.any()  # not enforced: only counted


def test_repetition_flags_long_runs_of_near_certain_tokens():
    cfg = OrchConfig.model_validate({"filters": [{"type": "repetition", "window": 5, "prob_threshold": 0.99,
                                                  "enforce": True}]})
    sure, unsure = math.log(0.995), math.log(0.5)
    cases = [comp(range(8), [sure] * 5 + [unsure] * 3),
             comp(range(8), [sure] * 4 + [unsure] + [sure] * 3),
             comp(range(3), [sure] * 3)]
    masked, m = Filters(cfg.filters, cfg.model.name).apply(cases)
    assert masked.tolist() == [True, False, False] and m["filters/masked"] == pytest.approx(1 / 3)


def test_enforced_filters_clear_the_loss_mask_of_flagged_completions():
    cfg = OrchConfig.model_validate({"batch_size": 2, "rollouts_per_example": 2, "seq_len": 64})
    comps = [comp([7, 8, 9], [-1, -1, -1]), comp([4, 5], [-1, -1])]
    adv = [np.ones(3), np.ones(2)]
    batch, _ = build_batch(1, [[1, 2]], [comps], np.array([1.0, 0.0]), adv, 0, cfg, masked=np.array([True, False]))
    s0, s1 = batch.samples()
    assert batch.loss_mask[s0].sum() == 0 and batch.loss_mask[s1].sum() == 2


def test_vocab_size_comes_from_the_model_directory():
    assert model_vocab_size("tidal:tiny-reverse") == 128
    gibberish = OrchConfig.model_validate({"filters": [{"type": "gibberish"}]}).filters
    Filters(gibberish, "tidal:tiny-reverse")
    with pytest.raises(ValueError, match="vocab_size"):
        Filters(gibberish, "served-elsewhere")


def test_soft_overlong_punishment_matches_dapo():
    from tidal.rewards.length import soft_overlong_punishment

    lengths = [0, 10, 12, 13, 15, 16, 17, 40]
    got = soft_overlong_punishment([[1] * n for n in lengths], max_completion_len=16, soft_punish_cache=4)
    want = [0.0, 0.0, 0.0, -0.25, -0.75, -1.0, -1.0, -1.0]
    assert got == pytest.approx(want)
    with pytest.raises(ValueError):
        soft_overlong_punishment([[1]], max_completion_len=4, soft_punish_cache=5)


def test_vocab_size_of_a_vision_language_model_comes_from_its_text_config(tmp_path):
    """A VLM's config.json (Idefics3 / SmolVLM, as transformers writes it) has its vocabulary under `text_config`
    only: the gibberish filter reads it there (`tidal.models.config.text_config`) instead of asking for
    `filters[].vocab_size`."""
    from transformers import Idefics3Config

    config = Idefics3Config(text_config={"model_type": "llama", "vocab_size": 77, "pad_token_id": 0},
                            vision_config={"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2})
    (tmp_path / "config.json").write_text(config.to_json_string())
    assert "vocab_size" not in json.loads((tmp_path / "config.json").read_text()), "the case under test"
    assert model_vocab_size(str(tmp_path)) == 77
    gibberish = OrchConfig.model_validate({"filters": [{"type": "gibberish"}]}).filters
    assert Filters(gibberish, str(tmp_path)).vocab == 77
