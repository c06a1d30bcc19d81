"""Orch `weight_broadcast.reload: factors` without a server: the worker's merge arithmetic
(`tidal.inference.backends.vllm.lora_merge`) against the trainer's merged weights and a float64 reference, its
refusals, and the selection (`tidal.colocate.factors`, the orch config, vLLM's command line). The served result is
checked against real vLLM in tests/integration/test_lora_factors.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.archs import build
from tidal.colocate.derive import Machine, derive_colocate
from tidal.config import ConfigError, InferConfig, OrchConfig, TrainConfig
from tidal.inference.backends.vllm.lora_merge import lora_scale, merged_weight, read_base, read_factors

CPU2 = Machine(cores=(0, 1))
FACTORS = {"weight_broadcast": {"reload": "factors"}}


def lora_policy(model_dir: Path, seed: int, **lora: object):
    from peft import LoraConfig, get_peft_model

    from tidal.models.lora import resolve_lora_targets
    from tidal.trainer.model.load import load_base_model

    torch.manual_seed(seed)
    base = load_base_model(str(model_dir), torch.device("cpu"), torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=resolve_lora_targets(base, "all-linear"),
                                            **lora))  # type: ignore[arg-type]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
@pytest.mark.parametrize("rslora", [False, True])
def test_the_worker_merge_is_the_trainers_merged_weight_bit_for_bit(arch, rslora, tmp_path):
    """What the worker hands vLLM equals what the trainer's merged copy holds (`lora_merged_weights`), tensor for
    tensor, under the same checkpoint names; the base comes from the checkpoint, not from the training model."""
    from tidal.trainer.publish.broadcast import lora_merged_weights

    model_dir = build(arch, tmp_path / "model")
    model = lora_policy(model_dir, 1, use_rslora=rslora)
    model.save_pretrained(str(tmp_path / "adapter"))
    factors, scale = read_factors(tmp_path / "adapter")
    assert scale == (16 / math.sqrt(8) if rslora else 2.0)
    trainer = dict(lora_merged_weights(model))
    assert sorted(factors) == sorted(trainer) and any("q_proj" in k for k in factors)
    base = read_base(model_dir, list(factors))
    for name, (a, b) in factors.items():
        assert torch.equal(merged_weight(base[name], a, b, scale, torch.float32), trainer[name]), name


def test_the_merge_matches_a_float64_reference_and_starts_from_the_base():
    torch.manual_seed(0)
    for out_f, in_f, r in ((64, 128, 8), (256, 128, 16), (48, 40, 1)):
        w, a, b = torch.randn(out_f, in_f), torch.randn(r, in_f), torch.randn(out_f, r) * 0.1
        ref = w.double() + (b.double() @ a.double()) * 0.75
        got = merged_weight(w, a, b, 0.75, torch.float32)
        assert got.dtype == torch.float32 and float((got.double() - ref).abs().max()) < 1e-5
        assert float((merged_weight(w, a, b, 1.5, torch.float32).double() - ref).abs().max()) > 1e-3  # scale matters
        assert torch.equal(w, w.clone()) and got.data_ptr() != w.data_ptr()  # the base copy is never written
    bf16 = torch.randn(8, 8).bfloat16()  # a bf16 checkpoint served in float32: upcast exactly, then summed
    assert torch.equal(merged_weight(bf16, torch.zeros(2, 8), torch.zeros(8, 2), 2.0, torch.float32), bf16.float())


def test_a_float32_checkpoint_served_in_bfloat16_keeps_updates_below_a_bfloat16_step():
    """bf16(W + delta), rounded once: a delta far below half a bfloat16 step of W still moves the served weights
    the way the float32 policy moves (round-to-nearest of W + delta against W's own rounding), where adding it to
    bf16(W) would round every element back to bf16(W). Checked against the float64 sum rounded to bfloat16."""
    torch.manual_seed(1)
    w = (torch.rand(256, 128) + 0.5) * 0.05 * torch.randn(256, 128).sign()  # |w| in [0.025, 0.075)
    a, b = torch.randn(8, 128) * 0.05, torch.randn(256, 8) * 1e-5
    d = (b.double() @ a.double()) * 2.0
    assert float(d.abs().max()) < 2 ** -9 * float(w.abs().min())  # smaller than half a bf16 step of any weight
    got = merged_weight(w, a, b, 2.0, torch.bfloat16)
    ref = (w.double() + d).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and int((got != ref).sum()) <= 2  # float32's sum rounds like float64's
    assert int((got != w.bfloat16()).sum()) > 100  # the update reaches the served weights
    # the served change correlates with the update: sum over the flips of sign agreement
    moved = got.double() - w.bfloat16().double()
    assert float((moved * d).sum()) > 0
    rounded_twice = w.bfloat16() + d.to(torch.bfloat16)  # the old arithmetic: every update rounded away
    assert int((rounded_twice != w.bfloat16()).sum()) < int((got != w.bfloat16()).sum()) // 10


@pytest.mark.parametrize("key,value", [("use_dora", True), ("modules_to_save", ["lm_head"]), ("fan_in_fan_out", True),
                                       ("rank_pattern", {"q_proj": 4}), ("alpha_pattern", {"q_proj": 4}),
                                       ("bias", "all")])
def test_adapters_the_merge_cannot_serve_are_refused_naming_the_key(key, value):
    with pytest.raises(ValueError, match=f"sets {key}: .*reload: factors"):
        lora_scale({"r": 8, "lora_alpha": 16, key: value})
    assert lora_scale({"r": 8, "lora_alpha": 16, "use_dora": False, "modules_to_save": None}) == 2.0


def test_an_adapted_weight_the_checkpoint_lacks_is_an_error_naming_it(tmp_path):
    model_dir = build("llama3", tmp_path / "model")
    with pytest.raises(ValueError, match=r"does not hold under that name \(e.g. model.language_model.layers.0.q"):
        read_base(model_dir, ["model.language_model.layers.0.q.weight", "model.layers.0.self_attn.q_proj.weight"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no safetensors checkpoint"):
        read_base(tmp_path / "empty", ["x"])
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    from safetensors.torch import save_file

    save_file({"base_model.model.x.lora_A.weight": torch.zeros(8, 4)},
              str(tmp_path / "a" / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="has no lora_B partner"):
        read_factors(tmp_path / "a")


# --- selection: tidal grpo, the orchestrator's config, vLLM's command line ---

def test_tidal_grpo_with_factors_writes_no_merged_copy_and_starts_vllm_able_to_merge():
    from tidal.inference.backends.vllm.server import WORKER_EXTENSION, vllm_argv

    tiny = "tidal:tiny-reverse"
    co = derive_colocate(TrainConfig(model=tiny), InferConfig(model=tiny), OrchConfig.model_validate(FACTORS), CPU2)
    assert co.orch.weight_broadcast.reload == "factors"
    assert not co.train.broadcast_merged and co.infer.weight_reload and not co.infer.enable_lora
    argv = vllm_argv(co.infer)
    assert argv[argv.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
    assert "--worker-extension-cls" not in vllm_argv(InferConfig(model=tiny))


def test_the_cpu_default_is_factors_where_they_can_serve_the_run_else_merged_copies():
    """`reload: auto` on a CPU-only machine (bench/WEIGHT_SYNC.md: faster and exact): a LoRA policy goes as its
    factors; full fine-tuning, QeRL, a mixture of experts, train `broadcast_merged: true` get merged copies; a GPU
    keeps LoRA adapters."""
    from tidal.colocate.derive import ModelFacts

    def derived(machine: Machine = CPU2, model: ModelFacts | None = None, **train: object) -> tuple[str, bool]:
        co = derive_colocate(TrainConfig(model="m", **train), InferConfig(model="m"), OrchConfig(), machine,
                             model=model)
        return co.orch.weight_broadcast.reload, co.train.broadcast_merged

    assert derived() == ("factors", False)
    assert derived(lora=False) == ("merged", True)
    assert derived(noise_scheduler={"enabled": True}, max_steps=4) == ("merged", True)
    assert derived(model=ModelFacts(moe=True)) == ("merged", True)
    assert derived(broadcast_merged=True) == ("merged", True)
    assert derived(Machine(cores=tuple(range(16)), has_gpu=True)) == ("auto", False)


@pytest.mark.parametrize("train,infer,why", [
    ({"lora": False}, {}, "train lora is false"),
    ({"noise_scheduler": {"enabled": True}, "max_steps": 4}, {}, "noise_scheduler.enabled"),
    ({}, {"backend": "sglang"}, "infer backend sglang"),
    ({}, {"tp": 2}, "infer tp 2"),
    ({}, {"extra_args": ["--quantization=fp8"]}, "served quantized"),
    ({"broadcast_merged": True}, {}, "train broadcast_merged is true"),
])
def test_tidal_grpo_refuses_factors_where_the_merge_cannot_serve_the_policy(train, infer, why):
    with pytest.raises(ConfigError, match=f"weight_broadcast.reload: factors .*{why}"):
        derive_colocate(TrainConfig(model="m", **train), InferConfig(model="m", **infer),
                        OrchConfig.model_validate(FACTORS), CPU2)


def test_a_qlora_base_and_a_quantized_checkpoint_are_refused():
    from tidal.colocate.factors import refusal

    orch = OrchConfig.model_validate(FACTORS)
    assert "qlora" in (refusal(TrainConfig(model="m", qlora_bnb=True), InferConfig(model="m"), orch, None) or "")
    quantized = {"quantization_config": {"quant_method": "fp8"}}
    assert "quantized" in (refusal(TrainConfig(model="m"), InferConfig(model="m"), orch, quantized) or "")
    plain = {"architectures": ["LlamaForCausalLM"]}
    assert refusal(TrainConfig(model="m"), InferConfig(model="m"), orch, plain) is None


@pytest.mark.parametrize("extra,key", [({"client": {"backend": "sglang"}}, "client.backend"),
                                       ({"weight_broadcast": {"reload": "factors", "type": "nccl"}},
                                        "weight_broadcast.type"),
                                       ({"weight_broadcast": {"reload": "factors", "policy_zero": "published"}},
                                        "weight_broadcast.policy_zero")])
def test_the_orchestrators_config_refuses_what_factors_cannot_combine_with(extra, key):
    with pytest.raises(ValueError, match=f"reload: factors does not combine with {key}"):
        OrchConfig.model_validate({**FACTORS, **extra})


def test_grpo_dry_run_exits_2_naming_the_key(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo", "--dry-run", "--output-dir", str(tmp_path / "r"),
                           "--orch.weight_broadcast.reload", "factors", "--train.lora", "false"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "weight_broadcast.reload: factors" in proc.stdout + proc.stderr
