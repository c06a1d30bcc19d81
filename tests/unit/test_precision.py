"""train `recipe` (tidal.trainer.model.precision): `fp8-hybrid` runs the base linears through float8 casts — emulated on
this CPU — and a linear layer's output and input gradient equal float64 references computed from e4m3 / e5m2
quantized operands with per-tensor scales; LoRA factors stay high precision and get gradients; the bundled model
trains a GRPO step under it. `nvfp4` and `qlora_fp4` are refused with exit 2 naming the key and the hardware."""

from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

from tidal.config import ConfigError, load_config
from tidal.config.train import TrainConfig
from tidal.models.sources import resolve_model
from tidal.trainer.model.precision import apply_recipe, fp8_linear_class

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CPU = torch.device("cpu")


def qdq(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 value of `t` cast to `dtype` with one scale per tensor (scale = fp8 max / amax), dequantized."""
    t64 = t.detach().double()
    scale = torch.finfo(dtype).max / t64.abs().max()
    return (t64 * scale).to(dtype).double() / scale


class Block(torch.nn.Module):
    """A linear layer to convert, one whose sizes FP8 GEMMs cannot take (not 16-aligned), and an `lm_head`."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 96)
        self.odd = torch.nn.Linear(96, 40)
        self.lm_head = torch.nn.Linear(40, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.odd(self.proj(x)))


def test_fp8_linear_equals_float64_reference_on_quantized_operands(caplog):
    torch.manual_seed(0)
    block = Block()
    plain = torch.nn.Linear(64, 96)
    plain.load_state_dict(block.proj.state_dict())
    with caplog.at_level(logging.INFO, logger="tidal.trainer"):
        assert apply_recipe(block, "fp8-hybrid", CPU) is block
    assert [r.getMessage() for r in caplog.records if "emulating" in r.getMessage()], "the notice is missing"
    assert isinstance(block.proj, fp8_linear_class())
    assert type(block.odd) is torch.nn.Linear and type(block.lm_head) is torch.nn.Linear
    layer = block.proj
    x = torch.randn(3, 5, 64) * 3  # (B, T, in)
    g = torch.randn(3, 5, 96) * 1e-3  # upstream gradient, (B, T, out)
    w = layer.weight

    # frozen weight (the LoRA base): forward e4m3 x e4m3, input gradient e5m2 x e4m3, no weight gradient
    w.requires_grad_(False)
    xr = x.clone().requires_grad_(True)
    y = layer(xr)
    ref = qdq(x, E4M3) @ qdq(w, E4M3).T + layer.bias.detach().double()
    assert y.dtype == torch.float32 and y.shape == (3, 5, 96)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    assert (y - plain(x)).abs().max() > 1e-3, "no fp8 rounding happened"
    y.backward(g)
    assert xr.grad is not None and w.grad is None
    torch.testing.assert_close(xr.grad.double(), qdq(g, E5M2) @ qdq(w, E4M3), rtol=1e-5, atol=1e-8)

    # trainable weight (full fine-tuning): torchao's path, weight gradient e5m2 x e4m3 too
    w.requires_grad_(True)
    y = layer(x)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    y.backward(g)
    assert w.grad is not None
    ref_gw = qdq(g, E5M2).reshape(-1, 96).T @ qdq(x, E4M3).reshape(-1, 64)
    torch.testing.assert_close(w.grad.double(), ref_gw, rtol=1e-5, atol=1e-8)


def test_frozen_base_weight_is_quantized_once():
    """A frozen base weight is cast to e4m3 once for all steps (forward, gradient-checkpoint recompute and backward
    reuse the codes), and again only after the weight changes; the numerics are the per-step cast's (float64
    reference on the quantized operands)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    block = apply_recipe(Block(), "fp8-hybrid", CPU)
    layer, fp8 = block.proj, fp8_linear_class()
    layer.weight.requires_grad_(False)
    before = fp8.weight_casts
    for _ in range(2):  # two steps, the second through a checkpoint (forward twice)
        x = (torch.randn(4, 7, 64) * 2).requires_grad_(True)
        y = checkpoint(layer, x, use_reentrant=False) if _ else layer(x)
        g = torch.randn_like(y) * 1e-3
        y.backward(g)
        torch.testing.assert_close(y.double(), qdq(x, E4M3) @ qdq(layer.weight, E4M3).T + layer.bias.double(),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad.double(), qdq(g, E5M2) @ qdq(layer.weight, E4M3), rtol=1e-5, atol=1e-8)
    assert fp8.weight_casts - before == 1
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # an in-place change: quantized again, and the output follows
    x = torch.randn(2, 64)
    torch.testing.assert_close(layer(x).double(), qdq(x, E4M3) @ qdq(layer.weight, E4M3).T + layer.bias.double(),
                               rtol=1e-5, atol=1e-5)
    assert fp8.weight_casts - before == 2


def test_lora_factors_stay_high_precision_and_get_gradients():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = apply_recipe(Block(), "fp8_hybrid", CPU)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["proj"]))
    layer = model.base_model.model.proj
    assert isinstance(layer.base_layer, fp8_linear_class())
    assert type(layer.lora_A["default"]) is torch.nn.Linear and type(layer.lora_B["default"]) is torch.nn.Linear
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.1)  # so that A gets a gradient too
    x = torch.randn(4, 64)
    model(x).square().sum().backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert set(trainable) == {"base_model.model.proj.lora_A.default.weight",
                              "base_model.model.proj.lora_B.default.weight"}
    for name, p in trainable.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert layer.base_layer.weight.grad is None
    # the LoRA branch is exact: output minus the fp8 base output is B A x * scale in full precision
    with torch.no_grad():
        base = layer.base_layer(x)
        lora = x @ layer.lora_A["default"].weight.T @ layer.lora_B["default"].weight.T * 2.0
        torch.testing.assert_close(layer(x), base + lora, rtol=1e-6, atol=1e-6)


def test_bundled_model_trains_a_grpo_step_under_fp8_hybrid():
    """Inference logprobs from the float32 model (what vLLM serves), one step under fp8-hybrid: the fp8 rounding
    shows as a small, non-zero mismatch; the adapters move."""
    from tests.unit.test_train_step import own_batch
    from tidal.trainer.grpo import train_step
    from tidal.trainer.model.load import load_policy
    from tidal.trainer.step.optim import make_optimizer

    model_dir = resolve_model("tidal:tiny-reverse")
    ref, _ = load_policy(TrainConfig(model=model_dir, device="cpu", recipe="fp32"))
    batch = own_batch(ref, np.random.default_rng(0), [False] * 4)
    cfg = TrainConfig(model=model_dir, device="cpu", recipe="fp8-hybrid", learning_rate=1e-2,
                      per_device_train_batch_size=1, sequence_len=40)
    model, device = load_policy(cfg)
    fp8 = fp8_linear_class()
    base = [m for n, m in model.named_modules() if n.endswith("base_layer")]
    assert len(base) == 4 * 7 and all(isinstance(m, fp8) for m in base)
    assert not isinstance(model.get_base_model().lm_head, fp8)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    m = train_step(model, make_optimizer(model, cfg), batch, cfg, device, pad_id=0)
    assert np.isfinite(m["loss"]) and m["grad_norm"] > 0
    assert 1e-7 < m["mismatch_kl"] < 1e-2, m["mismatch_kl"]
    moved = {n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])}
    assert moved == {n for n in before if "lora_B" in n}  # B starts at 0, so A gets no gradient at step 1


def test_nvfp4_recipe_and_fp4_qlora_are_refused(tmp_path):
    for text, key in (("recipe: nvfp4\n", "recipe"), ("qlora_fp4: true\n", "qlora_fp4")):
        path = tmp_path / "train.yaml"
        path.write_text(f"model: {resolve_model('tidal:tiny-reverse')}\n{text}")
        with pytest.raises(ConfigError, match=r"Blackwell GPUs \(SM100\+\)") as e:
            load_config(TrainConfig, path)
        assert key in str(e.value) and str(path) in str(e.value)
    r = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo-train", str(path), "--dry-run"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "qlora_fp4" in r.stderr and "SM100" in r.stderr, r.stderr
    for recipe in ("fp32", "bf16", "fp8-hybrid", "fp8_hybrid"):
        assert TrainConfig(model="m", recipe=recipe).recipe == recipe


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with FP8 matmuls (SM89+)")
def test_fp8_hybrid_on_hopper_runs_real_fp8_matmuls_with_weights_quantized_once():
    """On SM89+ the frozen base runs torch._scaled_mm (no emulation), the weight is cast once over two steps, and
    the output equals the float64 reference on the quantized operands within fp8 accumulation rounding."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    layer = apply_recipe(Block(), "fp8-hybrid", dev).to(dev, torch.bfloat16).proj
    layer.weight.requires_grad_(False)
    assert not layer.config.emulate
    fp8 = fp8_linear_class()
    before = fp8.weight_casts
    for _ in range(2):
        x = torch.randn(256, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
        y = layer(x)
        y.sum().backward()
    assert fp8.weight_casts - before == 1
    ref = qdq(x, E4M3) @ qdq(layer.weight, E4M3).T + layer.bias.double()
    torch.testing.assert_close(y.double(), ref, rtol=2e-2, atol=2e-2)
