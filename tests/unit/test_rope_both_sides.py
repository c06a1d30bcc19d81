"""`rope_scaling` means the same model in the trainer and in vLLM: merged over the model's own RoPE parameters
on both sides (a bare `--hf-overrides {"rope_scaling": ...}` makes vLLM drop the model's `rope_theta`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tidal.assets import resolve_model
from tidal.config.infer import InferConfig
from tidal.config.load import ConfigError
from tidal.inference.backends.vllm.server import vllm_argv
from tidal.models.rope import merge_rope, model_rope_parameters

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
    assert override["rope_parameters"] == {"rope_theta": 1e6, "rope_type": "linear", "factor": 2.0}


def test_trainer_builds_the_same_rope(model_dir):
    from tidal.trainer.model.hf import load_model_config

    cfg = load_model_config(str(model_dir), rope_scaling=LINEAR)
    assert cfg.rope_parameters["rope_theta"] == 1e6 and cfg.rope_parameters["rope_type"] == "linear"
    assert cfg.rope_parameters["factor"] == 2.0
