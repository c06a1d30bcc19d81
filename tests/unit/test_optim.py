"""torch AdamW's implementation by device (`tidal.trainer.step.optim.adamw_kernel`): fused on CUDA, torch's default
elsewhere (the CPU step unchanged), and the fused update equal to the default one (float64 on CPU; float32 on CUDA
in the `gpu` test)."""

from __future__ import annotations

import pytest
import torch

from tidal.config.train import TrainConfig
from tidal.trainer.step.optim import adamw_kernel, make_optimizer


def _steps(fused: bool | None, device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Three AdamW steps (weight decay, fresh random gradients) on two parameters; the parameters after."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(33, 7, generator=gen, dtype=dtype).to(device)),
              torch.nn.Parameter(torch.randn(5, generator=gen, dtype=dtype).to(device))]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99),
                            **({} if fused is None else {"fused": fused}))
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=dtype).to(device)
        opt.step()
    return [p.detach().cpu() for p in params]


def test_on_cpu_the_optimizer_is_torchs_default():
    model = torch.nn.Linear(4, 3)
    opt = make_optimizer(model, TrainConfig(model="m"))
    assert adamw_kernel(list(model.parameters())) == {}
    assert not opt.defaults["fused"] and not opt.defaults["foreach"]  # None: torch's per-tensor loop on CPU


def test_a_meta_parameter_keeps_the_default():
    assert adamw_kernel([torch.nn.Parameter(torch.empty(3, device="meta"))]) == {}


def test_the_fused_update_is_the_default_update():
    for a, b in zip(_steps(True, "cpu", torch.float64), _steps(None, "cpu", torch.float64), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make test-gpu on a GPU)")
def test_on_cuda_the_optimizer_is_fused_and_updates_as_foreach():
    model = torch.nn.Linear(4, 3).cuda()
    assert make_optimizer(model, TrainConfig(model="m")).defaults["fused"] is True
    for a, b in zip(_steps(True, "cuda", torch.float32), _steps(False, "cuda", torch.float32), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_adam_epsilon_is_the_optimizers_eps():
    """train `adam_epsilon` (TRL's `adam_epsilon`) reaches AdamW: with zero gradients' history the first step moves
    each weight by lr * g / (|g| + eps), so a large eps shrinks the step by exactly that factor."""
    steps = {}
    for eps in (1e-8, 0.5):
        model = torch.nn.Linear(3, 1, bias=False)
        torch.nn.init.zeros_(model.weight)
        opt = make_optimizer(model, TrainConfig(model="m", learning_rate=0.1, adam_epsilon=eps))
        assert opt.param_groups[0]["eps"] == eps
        model.weight.grad = torch.ones_like(model.weight)
        opt.step()
        steps[eps] = float(-model.weight[0, 0])
    assert steps[1e-8] == pytest.approx(0.1, rel=1e-6) and steps[0.5] == pytest.approx(0.1 / 1.5, rel=1e-6)
