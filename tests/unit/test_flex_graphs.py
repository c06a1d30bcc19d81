"""How many graphs `attention: flex` compiles (issue 33, item 2): a bounded number for a whole run, whatever the row
widths (`tidal.trainer.model.attention.flex`, module doc).

On CPU the kernel is compiled here with a counting wrapper around dynamo's eager backend (`flex.COMPILE_ON`), which
guards exactly as the CUDA build does (inductor only compiles the graphs dynamo hands it): 50 micro-batches of
random widths and row counts, packed samples (transformers' mask, with and without a sliding window) and shared
prompts (tidal's layout mask), each with and without autograd, stay within `graph_budget`, and the outputs equal the
masked softmax in float64. torch's flex_attention refuses inputs that need a gradient on CPU (no backward there):
that check is switched off for the forward-only calls here. The compiled kernel on CUDA (inductor, Triton) is the
`gpu` tests' part (tests/unit/test_attention_kernels.py).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch

from tests.archs import config_for
from tests.unit.test_packed_attention import packed_positions
from tests.unit.test_prompt_sharing import group_batch
from tidal.trainer.model.attention import flex, layout_mask, register
from tidal.trainer.model.attention.flex import (
    BLOCK,
    compiled_graphs,
    flex_packed_attention,
    graph_bucket,
    graph_buckets,
    graph_budget,
)
from tidal.trainer.step.packing import pack


class _Module(torch.nn.Module):
    is_causal = True


@pytest.fixture
def counted(monkeypatch):
    """flex_attention compiled on CPU too, through the counting backend (eager), from a clean dynamo cache; inputs
    that need a gradient allowed in the (forward-only) calls."""
    import torch._dynamo
    import torch._dynamo.config as dynamo
    import torch.nn.attention.flex_attention as fa

    torch._dynamo.reset()
    monkeypatch.setattr(flex, "COMPILE_ON", ("cuda", "cpu"))
    monkeypatch.setattr(flex, "_COMPILED", {})
    monkeypatch.setattr(flex, "_GRAPHS", [0])
    monkeypatch.setattr(flex, "_SEEN", {"largest": 0, "signatures": set(), "warned": set()})
    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    limits = {name: getattr(dynamo, name) for name in ("recompile_limit", "accumulated_recompile_limit")}
    yield
    torch._dynamo.reset()
    for name, value in limits.items():  # (monkeypatch's undo would delete dynamo's config entries)
        setattr(dynamo, name, value)


def _transformers_mask(pos: torch.Tensor, window: int | None, impl: str) -> Any:
    """The mask transformers builds for packed `pos` with attention implementation `impl` (a sliding-window layer's
    when `window`)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    cfg = config_for("qwen3")
    cfg.sliding_window = window
    cfg._attn_implementation = impl
    make = create_causal_mask if window is None else create_sliding_window_causal_mask
    return make(config=cfg, inputs_embeds=torch.zeros(*pos.shape, 8, dtype=torch.float64), attention_mask=None,
                past_key_values=None, position_ids=pos)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """(B, Hq, T, D) q, (B, Hkv, T, D) k/v, (B, 1 or B, T, T) bool -> (B, T, Hq, D): softmax over the allowed keys."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def _case(rng: np.random.Generator, i: int) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """Micro-batch `i`: (position ids, the mask the model gets on flex, the dense (B, 1, T, T) truth). Cycles
    through packed rows (transformers' rule), the same with a sliding window, and shared prompts (tidal's
    layout)."""
    kind = i % 3
    if kind == 2:
        while True:
            micro = pack(group_batch(rng, prompts=int(rng.integers(1, 4)), group=int(rng.integers(2, 6))),
                         int(rng.integers(60, 300)), int(rng.integers(1, 4)), share_prompts=True)
            shared = [mb for mb in micro if mb.shared_layout]
            if shared:
                pos = shared[int(rng.integers(len(shared)))].position_ids
                return pos, flex.layout_block_mask(pos, pos.shape[0]), layout_mask(pos)
    pos = packed_positions(rng, int(rng.integers(1, 5)), int(rng.integers(20, 400)), pad=True)
    window = int(rng.integers(2, 40)) if kind == 1 else None
    dense = _transformers_mask(pos, window, "sdpa")
    assert isinstance(dense, torch.Tensor)
    return pos, _transformers_mask(pos, window, register("flex")), dense


def test_graph_buckets_and_budget():
    for n in [*range(1, 2000, 13), 4095, 4096, 4097, 16383, 16384, 16385, 65537]:
        b = graph_bucket(n)
        assert b % BLOCK == 0 and b >= n and (b <= 1.25 * n or b - n < BLOCK), n
        assert graph_bucket(b) == b and b in graph_buckets(n)
    assert graph_buckets(16384) == sorted({graph_bucket(n) for n in range(1, 16385)})
    assert len({graph_bucket(n) for n in range(8193, 16385)}) == 4  # 4 compiled sizes per doubling
    assert graph_budget(16384) == 48 and graph_budget(16384, signatures=2) == 96
    assert graph_budget(16384) < 64  # dynamo's old 64, which runs of 13-68 steps used to pass


def test_own_block_mask_tiles_are_exact():
    """tidal's block mask counts tiles from per-query intervals: every tile it calls full is all True and every
    tile it skips all False in the dense mask of its own `mask_mod`, and partial tiles are exactly the rest
    (random samples, windows, prefixes before, overlapping or touching a sample)."""
    from torch.nn.attention.flex_attention import create_mask

    rng = np.random.default_rng(0)
    for _ in range(25):
        rows, n = int(rng.integers(1, 3)), int(rng.integers(1, 6)) * BLOCK
        lo, ps, pe = torch.zeros(3, rows, n, dtype=torch.int32)
        for r in range(rows):
            bounds = [0, *sorted(set(rng.integers(1, n, int(rng.integers(0, 8))).tolist())), n]
            window = int(rng.integers(1, 400)) if rng.random() < 0.4 else None
            for s, e in zip(bounds, bounds[1:], strict=False):
                col = torch.arange(s, e, dtype=torch.int32)
                lo[r, s:e] = col.clamp(min=s) if window is None else (col - window + 1).clamp(min=s)
                if s and rng.random() < 0.6:
                    a = int(rng.integers(0, s))
                    ps[r, s:e], pe[r, s:e] = a, s if rng.random() < 0.3 else int(rng.integers(a, s + 1))
        block = flex._own_mask(lo, ps, pe)
        nb = n // BLOCK
        tiles = create_mask(block.mask_mod, rows, 1, n, n)[:, 0].view(rows, nb, BLOCK, nb, BLOCK)
        tiles = tiles.permute(0, 1, 3, 2, 4).reshape(rows, nb, nb, -1)
        full, seen = tiles.all(-1), tiles.any(-1)
        for r in range(rows):
            for i in range(nb):
                kn, fn = int(block.kv_num_blocks[r, 0, i]), int(block.full_kv_num_blocks[r, 0, i])
                assert set(block.full_kv_indices[r, 0, i, :fn].tolist()) == set(full[r, i].nonzero()[:, 0].tolist())
                partial = seen[r, i] & ~full[r, i]
                assert set(block.kv_indices[r, 0, i, :kn].tolist()) == set(partial.nonzero()[:, 0].tolist())


def test_transformers_packed_rule_becomes_tidals_mask():
    """For packed rows transformers composes causal + packed samples (+ a sliding window on windowed layers); flex_mask
    recognizes it and builds tidal's mask (captures only tensors of the bucket's size), equal to transformers' own
    dense mask; a rule it does not know (here a 2D padding mask) keeps transformers' mask function."""
    from torch.nn.attention.flex_attention import create_mask
    from transformers.masking_utils import causal_mask_function

    rng = np.random.default_rng(1)
    pos = packed_positions(rng, 3, 150, pad=True)
    for window in (None, 7):
        block = _transformers_mask(pos, window, register("flex"))
        dense = _transformers_mask(pos, window, "sdpa")
        assert isinstance(dense, torch.Tensor)
        rows, width, folded = getattr(block, flex._KERNEL_MASK)
        assert (rows, width) == (3, 150) and folded.seq_lengths == (graph_bucket(450),) * 2
        mine = create_mask(block.mask_mod, 3, 1, *block.seq_lengths)[..., :150, :150]
        assert torch.equal(mine, dense.expand_as(mine))
        cells = [c.cell_contents for c in folded.mask_mod.__closure__]
        assert all(isinstance(c, torch.Tensor) and c.shape == (1, graph_bucket(450)) for c in cells)
    padding = torch.ones(3, 150, dtype=torch.bool)
    padding[0, :4] = False
    foreign = flex.flex_mask(3, 150, 150, mask_function=causal_mask_function, attention_mask=padding)
    assert not hasattr(foreign, flex._KERNEL_MASK)


def test_fifty_widths_stay_within_the_graph_budget(counted):
    """50 micro-batches of random widths (20-400 and shared-prompt packs) and 1-4 rows, each called without autograd,
    with it (only the query needing a gradient: LoRA on q and v, layer 0), and with grad mode on but no input needing
    one: at most `graph_budget` of the largest micro-batch graphs, two per size met; outputs equal the masked
    softmax in float64."""
    rng = np.random.default_rng(2)
    sizes, largest = set(), 0
    for i in range(50):
        pos, mask, dense = _case(rng, i)
        batch, width = pos.shape
        largest = max(largest, batch * width)
        sizes.add(graph_bucket(batch * width))
        q = torch.randn(batch, 2, width, 8, dtype=torch.float64)
        k, v = torch.randn(2, batch, 1, width, 8, dtype=torch.float64)
        expect = reference(q, k, v, dense)
        with torch.no_grad():
            out, _ = flex_packed_attention(_Module(), q, k, v, mask, scaling=8 ** -0.5, position_ids=pos)
        if i % 5 == 0:
            torch.testing.assert_close(out, expect, rtol=0, atol=1e-12)
        out, _ = flex_packed_attention(_Module(), q.requires_grad_(), k, v, mask, scaling=8 ** -0.5,
                                       position_ids=pos)
        assert out.requires_grad
        if i % 5 == 1:
            torch.testing.assert_close(out.detach(), expect, rtol=0, atol=1e-12)
        q.requires_grad_(False)
        out, _ = flex_packed_attention(_Module(), q, k, v, mask, scaling=8 ** -0.5, position_ids=pos)
        assert not out.requires_grad
    assert compiled_graphs() <= 2 * len(sizes) <= graph_budget(largest)
    assert compiled_graphs() > 0 and len(sizes) > 5


def test_two_widths_in_one_bucket_compile_once(counted):
    """The old failure: widths 130 and 131 (one bucket) each compiled, as did every new row count. Now one graph
    serves every micro-batch whose rows x width fold into the same size; a mask tidal does not build (transformers'
    rule with a 2D padding mask) still compiles per width, and the counter sees it."""
    from transformers.masking_utils import causal_mask_function

    rng = np.random.default_rng(3)

    def call(rows: int, width: int, foreign: bool = False) -> None:
        pos = packed_positions(rng, rows, width, pad=True)
        if foreign:
            padding = torch.ones(rows, width, dtype=torch.bool)
            padding[0, 0] = False
            mask = flex.flex_mask(rows, width, width, mask_function=causal_mask_function, attention_mask=padding)
        else:
            mask = _transformers_mask(pos, None, register("flex"))
        q, k, v = torch.randn(3, rows, 2, width, 8, dtype=torch.float64)
        with torch.no_grad():
            flex_packed_attention(_Module(), q, k, v, mask, scaling=None, position_ids=pos)

    assert graph_bucket(2 * 130) == graph_bucket(2 * 131) == graph_bucket(3 * 90) == graph_bucket(262)
    call(2, 130)
    assert compiled_graphs() == 1
    call(2, 131)
    call(3, 90)
    call(1, 262)
    assert compiled_graphs() == 1
    before = compiled_graphs()
    call(2, 130, foreign=True)
    call(2, 131, foreign=True)
    assert compiled_graphs() - before >= 2  # per width: what every flex micro-batch used to do


def test_warns_before_the_limit(monkeypatch, caplog):
    """One WARNING when the count passes the promise, one at 75% of dynamo's recompile limit; `_reserve` keeps the
    limit at twice the promise."""
    import torch._dynamo.config as dynamo

    monkeypatch.setattr(flex, "_SEEN", {"largest": 0, "signatures": set(), "warned": set()})
    limits = {name: getattr(dynamo, name) for name in ("recompile_limit", "accumulated_recompile_limit")}
    try:
        dynamo.recompile_limit = 8
        flex._reserve(16384, ("sig",))
        assert flex._promise() == graph_budget(16384) == 48 and dynamo.recompile_limit == 96
        with caplog.at_level(logging.WARNING, logger="tidal.trainer"):
            flex._check(48)
            assert not caplog.records
            flex._check(49)
            flex._check(50)
            assert len(caplog.records) == 1 and "more than the 48 promised" in caplog.records[0].getMessage()
            flex._check(72)
            flex._check(80)
    finally:
        for name, value in limits.items():
            setattr(dynamo, name, value)
    assert len(caplog.records) == 2 and "75% of dynamo's recompile limit (96)" in caplog.records[1].getMessage()
    assert "eagerly" in caplog.records[1].getMessage()


def test_train_step_logs_flex_graphs(tmp_path, monkeypatch):
    """A model on flex gets `flex_graphs` (compiled_graphs) in the step's metrics (metrics.jsonl); others do not."""
    import tidal.trainer.grpo as grpo
    from tests.archs import build
    from tidal.config.train import TrainConfig
    from tidal.trainer.model.load import load_policy
    from tidal.trainer.step.optim import make_optimizer

    path = build("llama3", tmp_path / "m")
    cfg = TrainConfig(model=str(path), device="cpu", sequence_len=128, per_device_train_batch_size=4)
    model, device = load_policy(cfg)
    batch = group_batch(np.random.default_rng(4), prompts=2, group=2)
    out = grpo.train_step(model, make_optimizer(model, cfg), batch, cfg, device, pad_id=0)
    assert "flex_graphs" not in out
    monkeypatch.setattr(grpo, "uses_flex", lambda m: True)
    monkeypatch.setattr(flex, "_GRAPHS", [7])
    out = grpo.train_step(model, make_optimizer(model, cfg), batch, cfg, device, pad_id=0)
    assert out["flex_graphs"] == 7
