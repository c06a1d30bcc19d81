"""The trainer builds the model vLLM serves: train `rope_scaling` is applied onto the Hugging Face config before
the model is built (keeping the model's other RoPE values), `trust_remote_code` reaches the model's and the
tokenizer's `from_pretrained`, and train `device` accepts `cuda:N`. Tiny models are built from configs in
temporary directories (no downloads)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tidal.config import ConfigError, TrainConfig
from tidal.config.load import validate
from tidal.models.sources import bundled
from tidal.trainer.model.load import load_base_model, load_policy, load_tokenizer, resolve_device

TINY = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=128, rope_theta=1e6)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("tiny-qwen3")
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**TINY)).save_pretrained(str(out))
    return out


def cpu_policy(model_dir: Path, **kw: object) -> torch.nn.Module:
    model, device = load_policy(TrainConfig(model=str(model_dir), device="cpu", lora=False, **kw))
    assert device == torch.device("cpu")
    return model.eval()


def test_rope_scaling_changes_the_loaded_model_and_keeps_rope_theta(model_dir):
    plain, scaled = cpu_policy(model_dir), cpu_policy(model_dir, rope_scaling=YARN)
    assert plain.config.rope_parameters == {"rope_theta": 1e6, "rope_type": "default"}
    assert scaled.config.rope_parameters == {**YARN, "rope_theta": 1e6}  # rope_theta not reset to 10000
    rot_plain, rot_scaled = plain.model.rotary_emb, scaled.model.rotary_emb
    assert not torch.equal(rot_plain.inv_freq, rot_scaled.inv_freq)
    assert rot_plain.attention_scaling == 1.0 and rot_scaled.attention_scaling > 1.0  # yarn's mscale
    ids = torch.arange(40)[None] % 50
    with torch.no_grad():
        assert not torch.allclose(plain(input_ids=ids).logits, scaled(input_ids=ids).logits)


def test_legacy_type_key_and_linear_scaling(model_dir):
    model = cpu_policy(model_dir, rope_scaling={"type": "linear", "factor": 2.0})
    assert model.config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
    base = cpu_policy(model_dir).model.rotary_emb.inv_freq
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, base / 2)


@pytest.mark.parametrize(("rope", "match"), [({"rope_type": "bogus"}, "unknown rope_type 'bogus'"),
                                             ({"rope_type": "yarn"}, "not valid for this model.*factor")])
def test_bad_rope_scaling_names_the_key(model_dir, rope, match):
    with pytest.raises(ConfigError, match=f"train rope_scaling .*{match}"):
        load_base_model(str(model_dir), torch.device("cpu"), torch.float32, rope_scaling=rope)


CUSTOM_CONFIG = """from transformers import Qwen3Config


class CustomConfig(Qwen3Config):
    model_type = "tidal_custom"
"""
CUSTOM_MODEL = """from transformers import Qwen3ForCausalLM

from .configuration_custom import CustomConfig


class CustomForCausalLM(Qwen3ForCausalLM):
    config_class = CustomConfig
"""
CUSTOM_TOKENIZER = """from transformers import PreTrainedTokenizerFast


class CustomTokenizer(PreTrainedTokenizerFast):
    pass
"""


@pytest.fixture()
def custom_dir(model_dir, tmp_path, monkeypatch) -> Path:
    """A model whose config, model and tokenizer classes live in the directory (`auto_map`), like a Hub model
    that needs `trust_remote_code`; transformers copies such code into a modules cache, here a temp one."""
    import transformers.dynamic_module_utils as dyn

    monkeypatch.setattr(dyn, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    out = tmp_path / "custom"
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config.update(model_type="tidal_custom", architectures=["CustomForCausalLM"],
                  auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                            "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})
    (out / "config.json").write_text(json.dumps(config))
    (out / "configuration_custom.py").write_text(CUSTOM_CONFIG)
    (out / "modeling_custom.py").write_text(CUSTOM_MODEL)
    (out / "tokenization_custom.py").write_text(CUSTOM_TOKENIZER)
    shutil.copy(Path(bundled("tidal:tiny-reverse")) / "tokenizer.json", out / "tokenizer.json")
    tok_cfg = json.loads((Path(bundled("tidal:tiny-reverse")) / "tokenizer_config.json").read_text())
    tok_cfg.pop("tokenizer_class", None)
    tok_cfg["auto_map"] = {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return out


def test_trust_remote_code_reaches_model_and_tokenizer(custom_dir):
    with pytest.raises(ValueError, match="trust_remote_code"):
        cpu_policy(custom_dir)
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_tokenizer(str(custom_dir))
    model = cpu_policy(custom_dir, trust_remote_code=True, rope_scaling=YARN)
    assert type(model).__name__ == "CustomForCausalLM" and model.config.rope_parameters["rope_theta"] == 1e6
    assert type(load_tokenizer(str(custom_dir), trust_remote_code=True)).__name__ == "CustomTokenizer"


def test_device_key_accepts_cuda_n_and_names_itself_when_wrong():
    assert TrainConfig(model="m", device="cuda:1").device == "cuda:1"
    for bad in ("gpu", "cuda:", "cuda:x", "cuda1"):
        with pytest.raises(ConfigError, match=r"key 'device'.*auto, cpu, cuda or cuda:N"):
            validate(TrainConfig, {"model": "m", "device": bad}, "train.yaml")


def test_cuda_device_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu") and resolve_device("cpu") == torch.device("cpu")
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match=f"train device is '{device}' but no CUDA device is available"):
            resolve_device(device)


def test_cuda_index_must_be_a_visible_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert resolve_device("auto") == torch.device("cuda") and resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"'cuda:2' but this process sees 2 GPU\(s\) \(CUDA_VISIBLE_DEVICES='2,3'\)"
                                          r": valid are cuda:0 to cuda:1"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("disable", [False, True])
def test_disable_dropout_sets_every_dropout_to_zero(disable):
    """train `disable_dropout` (TRL's): LoRA's dropout modules (and any other nn.Dropout) get p = 0; the policy
    then gives the same logits twice in train mode, where lora_dropout 0.5 otherwise makes them differ."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tidal.config.train import TrainConfig
    from tidal.trainer.model.load import prepare_policy

    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    cfg = TrainConfig(model="unused", lora_rank=4, lora_dropout=0.5, device="cpu", gradient_checkpointing=False,
                      disable_dropout=disable)
    model = prepare_policy(LlamaForCausalLM(conf), cfg, torch.device("cpu"))
    for name, p in model.named_parameters():  # a non-zero LoRA B, so the dropout shows in the output
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    drops = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and all(p == (0.0 if disable else 0.5) for p in drops)
    ids = torch.randint(0, 64, (1, 12))
    same = torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    assert same == disable
