"""torch AdamW's implementation by device (`tidal.trainer.step.optim.adamw_kernel`): fused on CUDA, torch's default
elsewhere (the CPU step unchanged), and the fused update equal to the default one (float64 on CPU), and to foreach
in float32 with one tolerance on CPU and on CUDA (the `gpu` test), both near a float64 numpy AdamW."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.config.train import TrainConfig
from tidal.trainer.step.optim import adamw_kernel, make_optimizer

CUDA_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
"""fused vs foreach in float32, on CUDA (`gpu` test) and on CPU alike: a few float32 roundings apart."""


def _steps(kernel: dict, device: str, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """Three AdamW steps (weight decay, fresh random gradients) on two parameters with torch's implementation flags
    `kernel` ({}: its default); the parameters after."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(33, 7, generator=gen, dtype=dtype).to(device)),
              torch.nn.Parameter(torch.randn(5, generator=gen, dtype=dtype).to(device))]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), **kernel)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=dtype).to(device)
        opt.step()
    return [p.detach().cpu() for p in params]


def _reference(seed: int) -> list[np.ndarray]:
    """`_steps`' run in float64 numpy, AdamW as its paper and torch's docs write it (decoupled weight decay, bias
    corrections), from the same float32 draws."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(33, 7, generator=gen).double().numpy(), torch.randn(5, generator=gen).double().numpy()]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    lr, wd, b1, b2, eps = 1e-2, 0.1, 0.9, 0.99, 1e-8
    for t in range(1, 4):
        grads = [torch.randn(p.shape, generator=gen).double().numpy() for p in params]
        for i, g in enumerate(grads):
            params[i] = params[i] * (1 - lr * wd)
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            step = lr / (1 - b1**t) * m[i] / (np.sqrt(v[i] / (1 - b2**t)) + eps)
            params[i] = params[i] - step
    return params


def test_on_cpu_the_optimizer_is_torchs_default():
    model = torch.nn.Linear(4, 3)
    opt = make_optimizer(model, TrainConfig(model="m"))
    assert adamw_kernel(list(model.parameters())) == {}
    assert not opt.defaults["fused"] and not opt.defaults["foreach"]  # None: torch's per-tensor loop on CPU


def test_a_meta_parameter_keeps_the_default():
    assert adamw_kernel([torch.nn.Parameter(torch.empty(3, device="meta"))]) == {}


def test_the_fused_update_is_the_default_update():
    for a, b in zip(_steps({"fused": True}, "cpu", torch.float64), _steps({}, "cpu", torch.float64), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_on_cpu_fused_updates_as_foreach_to_the_cuda_tolerance():
    """torch's fused AdamW for CPU against its foreach one, float32, with the tolerance the CUDA test uses; both
    against the float64 reference (fresh random inputs)."""
    seed = int(np.random.default_rng().integers(2**31))
    fused, foreach = _steps({"fused": True}, "cpu", torch.float32, seed), _steps({"foreach": True}, "cpu",
                                                                                 torch.float32, seed)
    for a, b, ref in zip(fused, foreach, _reference(seed), strict=True):
        torch.testing.assert_close(a, b, **CUDA_TOLERANCE)
        for x in (a, b):
            np.testing.assert_allclose(x.double().numpy(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make test-gpu on a GPU)")
def test_on_cuda_the_optimizer_is_fused_and_updates_as_foreach():
    model = torch.nn.Linear(4, 3).cuda()
    assert make_optimizer(model, TrainConfig(model="m")).defaults["fused"] is True
    for a, b in zip(_steps({"fused": True}, "cuda", torch.float32), _steps({"foreach": True}, "cuda", torch.float32),
                    strict=True):
        torch.testing.assert_close(a, b, **CUDA_TOLERANCE)


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
