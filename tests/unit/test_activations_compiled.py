"""Checkpointing around compiled attention, on CPU with inductor (issue 48, item 4).

On CUDA the flex kernel runs inside `torch.compile` (`tidal.trainer.model.attention.flex`), and a selective
checkpoint's dispatch mode sees no op inside inductor's code: `checkpoint_scope: elementwise` would run the whole
compiled attention again in the backward. FlexAttention has no CPU backward (torch 2.13), so these tests build the
same structure with an SDPA attention compiled by the same backend (`activations.keepable_inductor`) and count, with a
custom op inside the compiled region, how often its forward runs in one training step. `compile_layers` likewise:
the whole decoder layer compiled by inductor, the counter inside it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.unit.test_activations import SETTINGS, policy, step
from tests.unit.test_packed_attention import packed_positions
from tidal.trainer.model import activations
from tidal.trainer.model.kernels import compile_layers

RUNS = [0]
"""Forward runs of the attention (`_counted`), reset per step by the tests."""


@torch.library.custom_op("tidal_test::counted", mutates_args=())
def _counted(x: torch.Tensor) -> torch.Tensor:
    """The identity that counts its runs: an opaque call inside the compiled region, run each time the region's
    forward runs (and not when torch's checkpoint returns the region's kept outputs)."""
    RUNS[0] += 1
    return x.clone()


_counted.register_fake(lambda x: torch.empty_like(x))
_counted.register_autograd(lambda _ctx, grad: grad)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float | None) -> torch.Tensor:
    """(B, Hq, T, D) x (B, Hkv, T, D) -> (B, Hq, T, D): SDPA with the (B, 1, T, T) boolean mask, counted."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return _counted(out)  # type: ignore[no-any-return]


_COMPILED = torch.compile(_sdpa, backend=activations.keepable_inductor, dynamic=False)


def _interface(kernel):
    def attend(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **_kwargs):
        mask = attention_mask[:, :, :, :key.shape[2]] if attention_mask is not None else None
        return kernel(query, key, value, mask, scaling).transpose(1, 2).contiguous(), None
    return attend


def _register() -> tuple[str, str]:
    """Two transformers attention implementations: SDPA compiled on its own (as flex is on CUDA), and the same
    eager (for a layer compiled whole)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    for name, kernel in (("tidal_test_compiled", _COMPILED), ("tidal_test_counted", _sdpa)):
        AttentionInterface.register(name, _interface(kernel))
        AttentionMaskInterface.register(name, sdpa_mask)
    return "tidal_test_compiled", "tidal_test_counted"


@pytest.fixture
def region_runs(monkeypatch) -> list[int]:
    """Runs of inductor-compiled regions under a dispatch mode (a checkpoint's): the `inductor_compiled_code` op's
    kernel, which runs the region unless the checkpoint hands back its kept outputs. The counter the `gpu` test
    reads for flex on CUDA (no custom op can sit inside flex's compiled region)."""
    from torch._C import DispatchKey

    op = torch.ops.higher_order.inductor_compiled_code
    runs = [0]
    kernel = op.py_kernels[DispatchKey.CompositeExplicitAutograd]

    def counted(*args, **kwargs):
        runs[0] += 1
        return kernel(*args, **kwargs)

    monkeypatch.setitem(op.py_kernels, DispatchKey.CompositeExplicitAutograd, counted)
    return runs


def _batch(n: int = 48) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng()
    ids = torch.from_numpy(rng.integers(3, 120, (2, n)))
    return ids, packed_positions(rng, 2, n, pad=False), torch.from_numpy(rng.normal(size=ids.shape))


def test_elementwise_keeps_a_compiled_attention(monkeypatch, region_runs):
    """`checkpoint_scope: elementwise` around an inductor-compiled attention: its forward runs once per layer and
    micro-batch (twice for `layer` scope, and twice when the policy does not keep `inductor_compiled_code`: the
    structure the CUDA flex kernel had), with the gradients of no checkpointing (float64)."""
    compiled, _ = _register()
    ids, pos, w = _batch()
    ref = step(policy("qwen3", SETTINGS["none"], layers=2, attn="sdpa"), ids, pos, w)
    runs = {}
    for name in ("none", "elementwise", "every layer"):
        model = policy("qwen3", SETTINGS[name], layers=2, attn=compiled)
        RUNS[0] = region_runs[0] = 0
        lp, grads, _ = step(model, ids, pos, w)
        runs[name] = RUNS[0]
        if name == "elementwise":  # the region ran in the forward, under the checkpoint's mode, not again
            assert region_runs[0] == 2
        torch.testing.assert_close(lp, ref[0], rtol=0, atol=1e-10, msg=name)
        assert grads.keys() == ref[1].keys() and grads
        for n, g in ref[1].items():
            torch.testing.assert_close(grads[n], g, rtol=1e-8, atol=1e-10, msg=f"{name}: {n}")
    assert runs == {"none": 2, "elementwise": 2, "every layer": 4}, runs
    # the control: the policy without the compiled region in its list runs it again in the backward
    monkeypatch.setattr(activations, "_SAVED", {"ops": [op for op in activations._saved_op_list()
                                                        if op is not torch.ops.higher_order.inductor_compiled_code]})
    model = policy("qwen3", SETTINGS["elementwise"], layers=2, attn=compiled)
    RUNS[0] = region_runs[0] = 0
    step(model, ids, pos, w)
    assert RUNS[0] == 4 and region_runs[0] == 4


@pytest.mark.slow
@pytest.mark.parametrize(("scope", "runs"), [("mlp", 2), ("every layer", 4)])
def test_compiled_layers_run_attention_as_the_scope_says(scope, runs):
    """`compile_layers` (each decoder layer compiled whole by inductor, the counted attention inside): attention
    runs once per layer and micro-batch without a layer checkpoint (`mlp` scope: its checkpoint is inside the
    compiled layer) and twice with one (the checkpoint wraps the compiled layer); logprobs and gradients of eager
    (float64, to float32 rounding: inductor's fused RoPE rounds its float32 tables differently)."""
    _, counted = _register()
    ids, pos, w = _batch()
    model = policy("qwen3", SETTINGS[scope], layers=2, attn=counted)
    assert compile_layers(model) == 2
    step(model, ids, pos, w)  # compiles (its runs are not counted: dynamo may trace the layer more than once)
    RUNS[0] = 0
    ids, pos, w = _batch()
    ref = step(policy("qwen3", SETTINGS[scope], layers=2, attn=counted), ids, pos, w)
    RUNS[0] = 0
    lp, grads, _ = step(model, ids, pos, w)
    assert RUNS[0] == runs
    torch.testing.assert_close(lp, ref[0], rtol=0, atol=1e-5)
    assert grads.keys() == ref[1].keys() and grads
    for n, g in ref[1].items():  # relative to the tensor's scale: a LoRA A gradient is small where B is
        err = float((grads[n] - g).abs().max() / g.abs().max())
        assert err < 1e-4, (n, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make test-gpu on a GPU)")
def test_on_cuda_elementwise_keeps_the_compiled_flex_attention(monkeypatch, region_runs):
    """The CUDA structure itself: `attention: flex` (compiled by `flex.kernel` through `keepable_inductor`) under
    `checkpoint_scope: elementwise`: after a warm-up step, the flex region runs once per layer and micro-batch (twice
    without the kept op), with the gradients of no checkpointing (float32)."""
    from tidal.trainer.model.attention import register

    flex = register("flex")
    ids, pos, w = (t.cuda() for t in _batch(256))
    w = w.float()

    def measured(name: str) -> tuple[tuple[torch.Tensor, dict[str, torch.Tensor], int], int]:
        model = policy("qwen3", SETTINGS[name], layers=2, dtype=torch.float32, attn=flex).cuda()
        step(model, ids, pos, w)  # compiles
        region_runs[0] = 0
        return step(model, ids, pos, w), region_runs[0]

    (lp0, g0, _), _ = measured("none")
    (lp, grads, _), runs = measured("elementwise")
    assert runs == 2
    torch.testing.assert_close(lp, lp0, rtol=0, atol=1e-4)
    for n, g in g0.items():
        err = float((grads[n] - g).abs().max() / g.abs().max())
        assert err < 1e-3, (n, err)
    monkeypatch.setattr(activations, "_SAVED", {"ops": [op for op in activations._saved_op_list()
                                                        if op is not torch.ops.higher_order.inductor_compiled_code]})
    assert measured("elementwise")[1] == 4
