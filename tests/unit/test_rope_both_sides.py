"""`rope_scaling` means the same model in the trainer and in vLLM: merged over the model's own RoPE parameters
on both sides (a bare `--hf-overrides {"rope_scaling": ...}` makes vLLM drop the model's `rope_theta`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tidal.config.infer import InferConfig
from tidal.config.load import ConfigError
from tidal.inference.backends.vllm.server import vllm_argv
from tidal.models.rope import merge_rope, model_rope_parameters
from tidal.models.sources import resolve_model

LINEAR = {"type": "linear", "factor": 2.0}


@pytest.fixture
def model_dir(tmp_path):
    for f in Path(resolve_model("tidal:tiny-reverse")).iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"]["rope_theta"] = 1e6
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_merge_keeps_the_models_keys_and_reads_legacy_type():
    assert merge_rope({"rope_theta": 1e6, "rope_type": "default"}, LINEAR, "k") == {
        "rope_theta": 1e6, "rope_type": "linear", "factor": 2.0}
    assert model_rope_parameters({"rope_theta": 5e5, "rope_scaling": {"type": "yarn", "factor": 4}}) == {
        "rope_theta": 5e5, "rope_type": "yarn", "factor": 4}
    per_layer = {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}
    assert merge_rope(per_layer, {"full_attention": {"rope_type": "linear", "factor": 8.0}}, "k")[
        "full_attention"] == {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0}
    with pytest.raises(ConfigError, match="per layer type"):
        merge_rope(per_layer, LINEAR, "infer rope_scaling")


def test_vllm_gets_the_merged_parameters(model_dir):
    argv = vllm_argv(InferConfig(model=str(model_dir), rope_scaling=LINEAR))
    override = json.loads(argv[argv.index("--hf-overrides") + 1])
    assert override == {"rope_parameters": {"rope_theta": 1e6, "rope_type": "linear", "factor": 2.0}}
    vllm_config = pytest.importorskip("vllm.transformers_utils.config")
    served = vllm_config.get_config(str(model_dir), False, hf_overrides_kw=override)
    assert served.rope_parameters["rope_theta"] == 1e6 and served.rope_parameters["factor"] == 2.0


def test_a_vlms_own_rope_parameters_are_read_from_its_text_config(tmp_path):
    """A VLM's config.json keeps `rope_parameters` under `text_config` (`tidal.models.config.text_config`): the
    override keeps its `rope_theta` instead of sending the user's `rope_scaling` alone."""
    text = {"model_type": "llama", "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "idefics3", "text_config": text,
                                                      "vision_config": {}}))
    argv = vllm_argv(InferConfig(model=str(tmp_path), rope_scaling=LINEAR))
    override = json.loads(argv[argv.index("--hf-overrides") + 1])
    assert override == {"text_config": {"rope_parameters": {"rope_theta": 1e6, "rope_type": "linear", "factor": 2.0}}}


def vllm_reads(model_dir: Path, overrides: dict) -> object:
    """The HF config vLLM serves with `--hf-overrides overrides`, applied by vLLM's own code as its `ModelConfig`
    does (vllm/config/model.py, `__post_init__`): the flat keys through `get_config(hf_overrides_kw=...)`, the
    dict-valued ones afterwards through `ModelConfig._apply_dict_overrides` (a key naming a nested config, e.g.
    `text_config`, updates that config; another dict-valued key is set on the top-level config as it is). Not a
    whole `ModelConfig`: that inspects the model class in a vLLM subprocess."""
    from vllm.config import ModelConfig
    from vllm.transformers_utils.config import get_config

    flat = {k: v for k, v in overrides.items() if not isinstance(v, dict)}
    nested = {k: v for k, v in overrides.items() if isinstance(v, dict)}
    config = get_config(str(model_dir), False, hf_overrides_kw=flat)

    class Applier:  # the two methods use `self` only to call each other
        _update_nested = ModelConfig._update_nested
        _apply_dict_overrides = ModelConfig._apply_dict_overrides

    Applier()._apply_dict_overrides(config, nested)
    return config


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def qwen_vl_dir(request, tmp_path_factory):
    from tests.tiny_qwen_vl import build_tiny_qwen_vl

    return build_tiny_qwen_vl(tmp_path_factory.mktemp(request.param), request.param)


def test_a_qwen_vls_rope_scaling_reaches_its_language_model_on_both_sides(qwen_vl_dir):
    """A tiny Qwen2.5-VL / Qwen3-VL with `rope_scaling` linear x 2: vLLM (its override applied by its own code) and
    the trainer (its config and the rotary embedding of the model it builds) see the model's `rope_theta` and
    `mrope_section` with the scaling, in the text config the language model reads; the top level untouched."""
    vllm_config = pytest.importorskip("vllm.config")
    assert vllm_config is not None
    from transformers import AutoModelForImageTextToText

    from tidal.trainer.model.hf import load_model_config

    own = json.loads((qwen_vl_dir / "config.json").read_text())["text_config"]["rope_parameters"]
    expect = {**own, "rope_type": "linear", "factor": 2.0}
    argv = vllm_argv(InferConfig(model=str(qwen_vl_dir), rope_scaling=LINEAR))
    served = vllm_reads(qwen_vl_dir, json.loads(argv[argv.index("--hf-overrides") + 1]))
    trained = load_model_config(str(qwen_vl_dir), rope_scaling=LINEAR)
    for side, config in (("vLLM", served), ("trainer", trained)):
        text = config.get_text_config()  # type: ignore[attr-defined]
        assert text is not config, side
        assert {k: text.rope_parameters.get(k) for k in expect} == expect, side
        assert not getattr(config, "rope_parameters", None), side  # nothing a language model never reads
    rotary = AutoModelForImageTextToText.from_config(trained).model.language_model.rotary_emb
    dim = trained.get_text_config().head_dim
    inv = 1.0 / own["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim) / 2.0  # linear: positions / 2
    np.testing.assert_allclose(rotary.inv_freq.double().numpy(), inv, rtol=1e-6)


def test_trainer_builds_the_same_rope(model_dir):
    from tidal.trainer.model.hf import load_model_config

    cfg = load_model_config(str(model_dir), rope_scaling=LINEAR)
    assert cfg.rope_parameters["rope_theta"] == 1e6 and cfg.rope_parameters["rope_type"] == "linear"
    assert cfg.rope_parameters["factor"] == 2.0
