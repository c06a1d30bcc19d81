"""QLoRA bases (train `qlora_bnb` NF4, `qlora_fp8` FP8; tidal.trainer.model.quant): the base's linear layers are stored
quantized (bytes per parameter measured), LoRA trains on top, and what the trainer publishes — policy 0 and the
merged weights of later policies — is exactly the policy it scores: a plain model built from the published
weights gives the trainer's logits. Merged weights are checked against a float64 dequant + B A reference. Random-
init models of two architectures (tied Qwen3, untied Llama), saved to a temp dir; no downloads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from tidal.config.train import TrainConfig
from tidal.models.memory import estimate
from tidal.trainer.model.load import load_policy
from tidal.trainer.model.quant import base_report, dense_weight, quantized_linears
from tidal.trainer.publish.broadcast import checkpoint_keys, lora_layers, merged_state_dict
from tidal.transport import weights

V = 211
KINDS = {"nf4": "qlora_bnb", "fp8": "qlora_fp8"}
BYTES_PER_PARAM = {"nf4": (0.5, 0.58), "fp8": (1.0, 1.04)}  # NF4: + a 1 KiB code book per layer (tiny here)


def save_tiny(arch: str, path: Path) -> str:
    """A 2-layer random model of `arch` (input widths multiples of 128: FP8 blocks are 1 x 128)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    model = (Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=True)) if arch == "qwen3" else
             LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False)))
    model.save_pretrained(path)
    return str(path)


def qlora_policy(model_dir: str, kind: str, targets: list[str]) -> torch.nn.Module:
    cfg = TrainConfig(model=model_dir, device="cpu", lora_rank=4, lora_alpha=8, lora_target_modules=targets,
                      **{KINDS[kind]: True})
    model, _ = load_policy(cfg)
    for _, layer in lora_layers(model):  # non-zero adapters: merged weights must carry them
        for b in layer.lora_B.values():
            torch.nn.init.normal_(b.weight, std=0.05)
    return model


@pytest.mark.parametrize("kind", ["nf4", "fp8"])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_published_weights_are_the_policy_the_trainer_scores(tmp_path, kind, arch):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = save_tiny(arch, tmp_path / "base")
    # q/v adapted, k/o/gate/up/down quantized without adapters: both kinds of weight are published dequantized
    model = qlora_policy(model_dir, kind, ["q_proj", "v_proj"])
    quantized = dict(quantized_linears(model))
    assert len(quantized) == 2 * 7, sorted(quantized)  # every decoder linear, not lm_head
    assert not any("lm_head" in n for n in quantized)
    report = base_report(model, kind)
    low, high = BYTES_PER_PARAM[kind]
    assert low < report["bytes_per_param"] < high, report
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)

    keys = checkpoint_keys(model_dir)
    merged = merged_state_dict(model, keys)
    assert sorted(merged) == keys
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    assert not torch.equal(merged[k_proj], original[k_proj])  # the served base is the quantized one...
    assert (merged[k_proj] - original[k_proj]).abs().max() < 0.2 * original[k_proj].abs().max()  # ...close to it

    served = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    missing, unexpected = served.load_state_dict(merged, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    served.tie_weights()
    ids = torch.randint(0, V, (2, 19))
    model.train()  # the trainer scores in train mode (dropout 0)
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        theirs = served(input_ids=ids).logits
    assert (ours - theirs).abs().max() < 1e-4, (ours - theirs).abs().max()


@pytest.mark.parametrize("kind", ["nf4", "fp8"])
def test_merged_weight_is_dequantized_base_plus_lora_delta_in_float64(tmp_path, kind):
    model = qlora_policy(save_tiny("llama", tmp_path / "base"), kind, ["q_proj", "down_proj"])
    merged = merged_state_dict(model, checkpoint_keys(tmp_path / "base"))
    for key, layer in lora_layers(model):
        base = dense_weight(layer.get_base_layer().weight).double()
        a, b = layer.lora_A["default"].weight.double(), layer.lora_B["default"].weight.double()
        ref = base + layer.scaling["default"] * b @ a
        assert (merged[key].double() - ref).abs().max() < 1e-6, key


def test_policy_zero_is_published_dequantized_and_kept_by_pruning(tmp_path):
    from tidal.trainer.policy import build_policy
    from tidal.trainer.publish.broadcast import publish_base

    model_dir = save_tiny("qwen3", tmp_path / "base")
    cfg = TrainConfig(model=model_dir, device="cpu", lora_rank=4, qlora_bnb=True)
    run_dir = tmp_path / "run"
    p = build_policy(cfg, 3)
    publish_base(p.view, cfg, run_dir)
    stamp = weights.policy_stamp(run_dir, 0)
    assert stamp
    from safetensors.torch import load_file

    served = load_file(str(weights.merged_dir(run_dir, 0) / "model.safetensors"))
    assert sorted(served) == checkpoint_keys(model_dir)
    for name, module in quantized_linears(p.model):
        key = f"{name.removeprefix('base_model.model.')}.weight"
        assert torch.equal(served[key], dense_weight(module.weight)), key
    publish_base(p.view, cfg, run_dir)  # once per run directory
    assert weights.policy_stamp(run_dir, 0) == stamp
    for step in (1, 2, 3):  # later policies prune older ones, never policy 0
        weights.publish(run_dir, step, lambda d: None, keep=1)
    assert weights.stable_steps(run_dir) == [0, 3]


@pytest.mark.parametrize("bad, why", [
    ({"qlora_bnb": True, "qlora_fp8": True}, "set one"),
    ({"qlora_bnb": True, "lora": False}, "lora: true"),
    ({"qlora_fp8": True, "gpus": 2}, "gpus: 1 only"),
    ({"qlora_bnb": True, "recipe": "fp8-hybrid"}, "re-quantize"),
    ({"qlora_fp4": True}, "Blackwell"),
])
def test_qlora_combinations_that_cannot_work_are_refused(bad, why):
    with pytest.raises(ValidationError, match=why):
        TrainConfig(model="m", **bad)


def test_memory_estimate_counts_quantized_bases_and_8bit_moments():
    qwen3_8b = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)
    dense, nf4, fp8 = (estimate(qwen3_8b, base=b) for b in (None, "nf4", "fp8"))
    embed = 2 * 151936 * 4096 * 2  # untied embeddings + lm_head stay bf16
    # the decoder linears, 6.95e9 parameters: 2 bytes each in bf16 -> 0.516 (NF4) / 1.031 (FP8), plus three
    # dequantized bf16 copies of the largest linear (4096 x 12288) in flight
    assert dense.weights > fp8.weights > nf4.weights > embed
    assert 3.5 < (nf4.weights - embed) / 2**30 < 3.75, nf4.weights / 2**30
    assert 6.8 < (fp8.weights - embed) / 2**30 < 7.1, fp8.weights / 2**30
    plain, eight = estimate(qwen3_8b), estimate(qwen3_8b, optimizer_8bit=True)
    assert eight.lora / plain.lora == pytest.approx((8 + 2 + 8 / 256) / 16)
    full, full8 = estimate(qwen3_8b, lora_rank=None), estimate(qwen3_8b, lora_rank=None, optimizer_8bit=True)
    assert full.lora - full8.lora == pytest.approx(dense.weights / 2 * (8 - 2 - 8 / 256), rel=1e-6)


def test_orchestrator_waits_for_policy_zero_when_told_the_trainer_publishes_it(tmp_path):
    """orch weight_broadcast.policy_zero: published: no rollout before the trainer's policy 0 exists; a clear
    timeout naming it when it never comes (before any request reaches a server)."""
    import asyncio

    from tidal.config.orch import ClientSection
    from tidal.inference.backends.vllm.client import VllmClient
    from tidal.orchestrator.policy import PolicyTracker

    async def attempt(await_base: bool) -> float:
        # nothing listens there: only the wait may run
        client = VllmClient(ClientSection(base_url=["http://127.0.0.1:9/v1"]))
        try:
            tracker = PolicyTracker(client, "m", tmp_path, "default", await_base=await_base)
            return await tracker._wait_published(0, timeout_s=0.3)
        finally:
            await client.close()

    assert asyncio.run(attempt(False)) == 0  # the served model is policy 0: nothing to wait for
    with pytest.raises(TimeoutError, match=r"policy 0 was not published .*weight_broadcast.policy_zero is 'published'"):
        asyncio.run(attempt(True))
    weights.publish(tmp_path, 0, lambda d: None)
    assert asyncio.run(attempt(True)) == 0


@pytest.mark.parametrize("kind", ["nf4", "fp8"])
def test_qlora_with_recipe_bf16_on_cpu_is_the_float32_policy_to_bf16_rounding(tmp_path, kind):
    """`recipe: bf16` (bfloat16 autocast on CPU) over a quantized base: the same policy as the float32 recipe up to
    bf16 rounding — logprobs within bf16's gap (not equal: the matmuls do run in bf16; not further) and the
    adapters' gradients within a few percent in norm."""
    import numpy as np

    from tidal.trainer.model.precision import AUTOCAST_ATTR
    from tidal.trainer.step.logprobs import forward_logprobs

    model_dir = save_tiny("llama", tmp_path / "base")
    models = {}
    for recipe in ("fp32", "bf16"):
        cfg = TrainConfig(model=model_dir, device="cpu", lora_rank=4, lora_alpha=8, recipe=recipe,
                          lora_target_modules=["q_proj", "v_proj", "down_proj"], **{KINDS[kind]: True})
        models[recipe], _ = load_policy(cfg)
    assert getattr(models["bf16"], AUTOCAST_ATTR) == torch.bfloat16
    assert getattr(models["fp32"], AUTOCAST_ATTR, None) is None
    for _, layer in lora_layers(models["bf16"]):
        for b in layer.lora_B.values():
            torch.nn.init.normal_(b.weight, std=0.05)
    trainable = {n: p for n, p in models["bf16"].named_parameters() if p.requires_grad}
    with torch.no_grad():
        for n, p in models["fp32"].named_parameters():
            if n in trainable:
                p.copy_(trainable[n])
    rng = np.random.default_rng()
    ids = torch.from_numpy(rng.integers(0, V, (2, 48)))
    pos = torch.arange(48).repeat(2, 1)
    w = torch.from_numpy(rng.normal(size=(2, 48))).float()
    lps, grads = {}, {}
    for recipe, m in models.items():
        m.train()
        lp = forward_logprobs(m, ids, pos)
        (lp * w).sum().backward()
        lps[recipe] = lp.detach()
        grads[recipe] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    gap = (lps["bf16"] - lps["fp32"]).abs()[:, 1:]
    assert 1e-5 < float(gap.mean()) < 5e-2, float(gap.mean())
    assert grads["fp32"].keys() == grads["bf16"].keys() == trainable.keys()
    for n, g in grads["fp32"].items():
        assert float((grads["bf16"][n] - g).norm()) <= 0.1 * float(g.norm()), f"gradient of {n}"
