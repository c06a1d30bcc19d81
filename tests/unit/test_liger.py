"""Liger Kernel in the trainer (train `liger_kernel`, `tidal.trainer.model.kernels.liger`): which modules each
architecture's patch replaces (models built from configs, no Triton needed), LoRA still wrapping the MLP's linear
layers, the refusals (exit 2 naming the key: no CUDA, not installed, other architectures), and on CUDA (`gpu`) the
logprobs and LoRA gradients with Liger's kernels as close to float32 as without them, bf16, tiny Qwen3 and Llama."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from tests.archs import config_for
from tidal.config.load import ConfigError
from tidal.config.train import TrainConfig
from tidal.trainer.model.kernels.liger import check_config, check_runtime, liger_targets

ALL = ["rms_norm", "swiglu", "rope"]
LAYERS = 2  # tests.archs.BASE


def tiny(arch: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config_for(arch))


@pytest.mark.parametrize("arch,norms,module", [
    ("qwen3", 4 * LAYERS + 1, "transformers.models.qwen3.modeling_qwen3"),  # + the attention's q_norm and k_norm
    ("llama3", 2 * LAYERS + 1, "transformers.models.llama.modeling_llama"),
    ("qwen2.5", 2 * LAYERS + 1, "transformers.models.qwen2.modeling_qwen2"),
    ("mistral", 2 * LAYERS + 1, "transformers.models.mistral.modeling_mistral"),
])
def test_each_family_patches_its_norms_mlps_and_rope(arch, norms, module):
    model = tiny(arch)
    targets = liger_targets(model, ALL)
    assert len(targets["rms_norm"]) == norms and "model.norm" in targets["rms_norm"]
    assert all(type(model.get_submodule(n)).__name__.endswith("RMSNorm") for n in targets["rms_norm"])
    assert targets["swiglu"] == [f"model.layers.{i}.mlp" for i in range(LAYERS)]
    assert targets["rope"] == [module] and callable(importlib.import_module(module).apply_rotary_pos_emb)
    assert liger_targets(model, ["swiglu"]).keys() == {"swiglu"}


def test_lora_wraps_the_linear_layers_the_patched_mlp_calls(tmp_path):
    """Liger's SwiGLU forward calls `gate_proj` / `up_proj` / `down_proj` by attribute: after PEFT those are its
    LoRA layers, so the adapters still train."""
    from peft.tuners.lora import Linear as LoraLinear

    from tidal.trainer.model.load import add_lora

    model = tiny("qwen3")
    names = liger_targets(model, ["swiglu"])["swiglu"]
    peft_model = add_lora(model, TrainConfig(model="m", lora_rank=4))
    for name in names:
        mlp = peft_model.get_base_model().get_submodule(name)
        assert all(isinstance(getattr(mlp, p), LoraLinear) for p in ("gate_proj", "up_proj", "down_proj")), name


@pytest.mark.parametrize("arch", ["gemma2", "phi3", "olmo2", "qwen3-moe"])
def test_other_architectures_are_refused(arch):
    with pytest.raises(ConfigError, match=r"train liger_kernel \['rms_norm'\].*llama, mistral, qwen2, qwen3 text"):
        liger_targets(tiny(arch), ["rms_norm"])


def test_a_vision_language_model_and_a_non_silu_mlp_are_refused():
    with pytest.raises(ConfigError, match=r"text models only"):
        check_config(["rope"], {"model_type": "qwen2", "vision_config": {}}, "vl")
    with pytest.raises(ConfigError, match=r"liger_kernel swiglu: m's MLP activation is gelu"):
        check_config(["swiglu"], {"model_type": "llama", "hidden_act": "gelu"}, "m")
    check_config(["rms_norm", "rope"], {"model_type": "llama", "hidden_act": "gelu"}, "m")  # no swiglu: fine


def test_refused_without_cuda_and_without_the_package(monkeypatch):
    with pytest.raises(ConfigError, match=r"liger_kernel \['rope'\]: the trainer runs on cpu.*Triton/CUDA only"):
        check_runtime(["rope"], "cpu")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"liger-kernel is not installed.*pip install liger-kernel==0.8.5"):
        check_runtime(["rope"], "cuda")  # a device name only: nothing runs on it
    check_runtime([], "cpu")  # off: nothing to refuse


def test_the_config_key():
    assert TrainConfig(model="m").liger_kernel == []
    assert TrainConfig(model="m", liger_kernel=["rope", "swiglu"]).liger_kernel == ["rope", "swiglu"]
    with pytest.raises(ValidationError, match="names an op twice"):
        TrainConfig(model="m", liger_kernel=["rope", "rope"])
    with pytest.raises(ValidationError):
        TrainConfig(model="m", liger_kernel=["fused_linear_cross_entropy"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_the_dry_run_refuses_it_on_a_machine_without_cuda(capsys):
    from tidal.cli import main

    code = main(["grpo", "--dry-run", "--train.device", "cpu", "--train.liger_kernel", "[rms_norm, swiglu]"])
    err = capsys.readouterr().err
    assert code == 2 and "train liger_kernel ['rms_norm', 'swiglu']" in err and "Triton/CUDA only" in err, err[-2000:]


def _run(model_dir: str, recipe: str, liger: list[str], scope: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logprobs of packed rows and the LoRA gradients of a weighted logprob loss (non-zero B factors)."""
    from tidal.trainer.model.load import load_policy
    from tidal.trainer.step.logprobs import forward_logprobs

    cfg = TrainConfig(model=model_dir, device="cuda", recipe=recipe, gradient_checkpointing=True,
                      checkpoint_scope=scope, attention="per_sample", liger_kernel=liger, lora_rank=4, lora_alpha=8)
    model, _ = load_policy(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    lengths = [13, 8, 11]
    ids = torch.randint(0, 128, (2, sum(lengths)), generator=gen).cuda()
    pos = torch.cat([torch.arange(n) for n in lengths]).repeat(2, 1).cuda()
    mask = torch.cat([torch.arange(n) >= n // 2 for n in lengths]).repeat(2, 1).cuda()
    weights = torch.randn(ids.shape, generator=gen).cuda()
    lp = forward_logprobs(model, ids, pos, 1.0, chunk_size=16, loss_mask=mask)
    (lp.float() * weights * mask).sum().backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    if liger:
        from liger_kernel.transformers.rms_norm import LigerRMSNorm

        assert model.get_base_model().model.norm.forward.__func__ is LigerRMSNorm.forward
    return (lp.float() * mask).detach(), grads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make test-gpu on a GPU)")
@pytest.mark.parametrize("scope", ["layer", "mlp"])
@pytest.mark.parametrize("arch", ["qwen3", "llama3"])
def test_on_cuda_liger_keeps_logprobs_and_lora_gradients_within_bf16(arch, scope, tmp_path: Path, monkeypatch):
    """Against float32 without Liger, bf16 with Liger's kernels is off by no more than bf16 without them (twice,
    plus a floor)."""
    from tests.archs import build

    model_dir = str(build(arch, tmp_path / arch))
    modeling = importlib.import_module(f"transformers.models.{config_for(arch).model_type}."
                                       f"modeling_{config_for(arch).model_type}")
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", modeling.apply_rotary_pos_emb)  # restored after the test
    ref_lp, ref = _run(model_dir, "fp32", [], scope)
    off_lp, off = _run(model_dir, "bf16", [], scope)
    on_lp, on = _run(model_dir, "bf16", ALL, scope)
    assert modeling.apply_rotary_pos_emb.__module__ == "liger_kernel.transformers.rope"
    assert sorted(on) == sorted(ref) and len(ref) == LAYERS * 7 * 2
    lp_off, lp_on = float((off_lp - ref_lp).abs().max()), float((on_lp - ref_lp).abs().max())
    assert lp_on <= 2 * lp_off + 1e-2, (lp_on, lp_off)

    def rel(g: dict[str, torch.Tensor]) -> float:
        diff = torch.cat([(g[n] - ref[n]).flatten() for n in ref])
        return float(diff.norm() / torch.cat([r.flatten() for r in ref.values()]).norm())

    assert rel(on) <= 2 * rel(off) + 1e-2, (rel(on), rel(off))


def test_refused_where_the_policy_is_built_on_cpu():
    from tidal.trainer.model.load import prepare_policy

    with pytest.raises(ConfigError, match=r"Triton/CUDA only"):
        prepare_policy(tiny("qwen3"), TrainConfig(model="m", device="cpu", liger_kernel=["swiglu"]),
                       torch.device("cpu"))


def test_the_mlp_checkpoint_runs_a_forward_bound_in_place_of_the_class_one():
    """`checkpoint_scope: mlp` wraps the MLP's own forward as found (Liger's SwiGLU is bound on the instance), not its
    class's."""
    import types

    from tidal.trainer.model.load import prepare_policy

    model = tiny("qwen3")
    calls: list[int] = []
    for name in liger_targets(model, ["swiglu"])["swiglu"]:
        mlp = model.get_submodule(name)
        mlp.forward = types.MethodType(lambda self, x: calls.append(1) or type(self).forward(self, x), mlp)
    cfg = TrainConfig(model="m", device="cpu", gradient_checkpointing=True, checkpoint_scope="mlp", lora_rank=4)
    policy = prepare_policy(model, cfg, torch.device("cpu"))
    policy(input_ids=torch.tensor([[3, 4, 5]])).logits.sum().backward()
    assert len(calls) == 2 * LAYERS, "each MLP's bound forward ran, and again in the checkpoint's recompute"
