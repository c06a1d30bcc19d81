"""The attention kernels of `tidal.trainer.model.attention` (train `attention`): flex_attention with the packed layout's
block mask against the masked float64 reference, for packed documents and the shared-prompt layout, GQA, and the
models of the architecture matrix; how `auto` chooses; the dense fallback's notice.

flex_attention has no backward on CPU (torch 2.13), so on CPU these check forwards in float64 (torch's eager flex
is its reference implementation, running the same block mask and mask_mod as the compiled CUDA kernel); outputs
and gradients of the compiled kernel against the dense mask are the `gpu` tests at the end (bfloat16).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from tests.archs import ARCHS, config_for
from tests.unit.test_packed_attention import packed_positions
from tests.unit.test_prompt_sharing import group_batch
from tidal.models.families import has_linear_attention
from tidal.trainer.model.attention import choose, flex, implementation, layout_mask, register
from tidal.trainer.model.attention.flex import bucket, flex_packed_attention
from tidal.trainer.step.logprobs import forward_logprobs
from tidal.trainer.step.packing import pack

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make test-gpu on a GPU)")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """(B, Hq, T, D) q, (B, Hkv, T, D) k/v, (B, T, T) bool -> (B, T, Hq, D): softmax over the allowed keys."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, Hq, T, T)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def test_bucket_is_a_tile_multiple_close_above():
    for n in [*range(1, 600, 7), 1024, 16383, 16384, 16385, 20480, 65536, 65537]:
        b = bucket(n)
        assert b % flex.BLOCK == 0 and b >= n and (b <= 1.125 * n or b - n < flex.BLOCK), n
    assert len({bucket(n) for n in range(8193, 16385)}) == 8  # few compiled shapes per doubling


class _Module(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("share", [False, True])
def test_flex_equals_the_masked_reference_float64(share):
    """flex_packed_attention on a random packed layout with GQA (4 query heads over 2 KV heads), with the block
    mask built both ways it is built in training: from transformers' packed rule (`flex_mask`, no shared prompts)
    and from the packer's 4D layout mask (shared prompts): equal to the explicit masked softmax in float64."""
    from transformers.masking_utils import create_causal_mask

    rng = np.random.default_rng()
    if share:
        micro = pack(group_batch(rng, prompts=3, group=4), 200, 2, share_prompts=True)
        pos, mask = micro[0].position_ids, micro[0].attention_mask
        assert mask is not None and int((pos[:, 1:] != pos[:, :-1] + 1).sum()) > 3
    else:
        pos = packed_positions(rng, 2, 150, pad=True)
        cfg = config_for("qwen3")
        cfg._attn_implementation = register("flex")
        mask = create_causal_mask(config=cfg, inputs_embeds=torch.zeros(2, 150, 8, dtype=torch.float64),
                                  attention_mask=None, past_key_values=None, position_ids=pos)
        from torch.nn.attention.flex_attention import BlockMask

        assert isinstance(mask, BlockMask) and mask.seq_lengths == (bucket(150), bucket(150))
    batch, width = pos.shape
    q = torch.randn(batch, 4, width, 16, dtype=torch.float64)
    k, v = torch.randn(2, batch, 2, width, 16, dtype=torch.float64)
    with torch.no_grad():
        out, _ = flex_packed_attention(_Module(), q, k, v, mask, scaling=16 ** -0.5, position_ids=pos)
    expect = reference(q, k, v, layout_mask(pos)[:, 0] if share else layout_mask_unshared(pos))
    torch.testing.assert_close(out, expect, rtol=0, atol=1e-12)


def layout_mask_unshared(pos: torch.Tensor) -> torch.Tensor:
    """(B, T, T): block-causal over the runs of consecutive positions (transformers' packed rule), by a scan."""
    batch, width = pos.shape
    out = torch.zeros(batch, width, width, dtype=torch.bool)
    for b, row in enumerate(pos.tolist()):
        start = 0
        for i in range(1, width + 1):
            if i == width or row[i] != row[i - 1] + 1:
                out[b, start:i, start:i] = torch.ones(i - start, i - start, dtype=torch.bool).tril()
                start = i
    return out


def _pair(name: str, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    # the MoE's experts as transformers' per-expert loop: its default grouped matmul has no float64 kernel
    experts = {"experts_implementation": "eager"} if name.endswith("-moe") else {}
    ref = AutoModelForCausalLM.from_config(config_for(name), attn_implementation="sdpa", dtype=dtype, **experts)
    ours = AutoModelForCausalLM.from_config(config_for(name), attn_implementation=register("flex"), dtype=dtype,
                                            **experts)
    ours.load_state_dict(ref.state_dict())
    return ref.eval(), ours.eval()


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_flex_models_equal_masked_sdpa(name, monkeypatch):
    """Every architecture of the matrix with `attention: flex`: logprobs of packed rows (padding run included) and
    of shared-prompt micro-batches equal transformers' SDPA with the dense mask (float64; the MoE's experts one by one).
    gemma2 (soft-capped logits) takes the dense fallback, every other model the flex kernel."""
    import transformers.integrations.sdpa_attention as sdpa

    if has_linear_attention(config_for(name)):  # Qwen3.5: refused (it cannot read a block mask), auto avoids it
        cuda = torch.device("cuda")
        assert choose("auto", cuda, linear=True) == "per_sample" and choose("auto", cuda) == "flex"
        with pytest.raises(ValueError, match="linear-attention layers"):
            choose("flex", cuda, linear=True)
        return
    atol = 1e-10
    ref, ours = _pair(name, torch.float64)
    rng = np.random.default_rng()
    ids = torch.from_numpy(rng.integers(3, 120, (2, 96)))
    pos = packed_positions(rng, 2, 96, pad=True)
    fell_back = []
    real = sdpa.sdpa_attention_forward
    with torch.no_grad():
        a = forward_logprobs(ref, ids, pos)
        monkeypatch.setattr(sdpa, "sdpa_attention_forward", lambda *x, **k: fell_back.append(1) or real(*x, **k))
        b = forward_logprobs(ours, ids, pos)
    torch.testing.assert_close(b, a, rtol=0, atol=atol)
    assert bool(fell_back) == (name == "gemma2")
    if name == "gemma2":
        return
    from torch.nn.attention.flex_attention import BlockMask

    for mb in pack(group_batch(rng, prompts=2, group=3), 96, 2, share_prompts=True):
        with torch.no_grad():
            a = forward_logprobs(ref, mb.input_ids, mb.position_ids, attention_mask=mb.mask_for(ref))
            # the 4D layout mask (checked against the layout), and the block mask the trainer hands a flex model
            for mask in (mb.attention_mask, mb.mask_for(ours)):
                fell_back.clear()
                b = forward_logprobs(ours, mb.input_ids, mb.position_ids, attention_mask=mask)
                assert not fell_back
                torch.testing.assert_close(b, a, rtol=0, atol=atol)
        assert isinstance(mb.mask_for(ours), BlockMask) == mb.shared_layout
        assert mb.mask_for(ref) is mb.attention_mask


def test_shared_layout_mask_is_built_where_it_is_used():
    """A micro-batch with shared prompts carries no T x T mask out of the packer (16k-token rows would make 256 MiB
    of it on the CPU, copied to the GPU): its `attention_mask` is built on first use, on the device of its position
    ids, once (the same tensor for every layer), and equals the layout mask; `to(device)` does not copy it."""
    micro = pack(group_batch(np.random.default_rng(), prompts=2, group=4), 128, 2, share_prompts=True)
    mb = next(m for m in micro if m.shared_layout)
    assert "_layout_mask" not in mb.__dict__
    moved = mb.to(torch.device("cpu"))
    mask = moved.attention_mask
    assert mask is not None and moved.attention_mask is mask and "_layout_mask" not in mb.__dict__
    assert torch.equal(mask, layout_mask(mb.position_ids))
    assert all(m.attention_mask is None for m in pack(group_batch(np.random.default_rng(), 2, 4), 128, 2))


def test_a_4d_mask_that_is_not_the_layout_goes_dense(caplog):
    """A (B, 1, T, T) mask other than the layout's (here: the layout with one more key) is computed as given, by
    SDPA, and the log says so once."""
    ref, ours = _pair("llama3", torch.float64)
    rng = np.random.default_rng()
    ids = torch.from_numpy(rng.integers(3, 120, (1, 64)))
    pos = packed_positions(rng, 1, 64, pad=False)
    mask = layout_mask(pos).clone()
    mask[0, 0, 63, 0] = True
    flex._NOTICED.clear()
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="tidal.trainer"):
        b = forward_logprobs(ours, ids, pos, attention_mask=mask)
        a = forward_logprobs(ref, ids, pos, attention_mask=mask)
    torch.testing.assert_close(b, a, rtol=0, atol=1e-10)
    assert sum("not the packed layout" in r.getMessage() for r in caplog.records) == 1


def test_one_sequence_per_row_takes_the_causal_kernel(monkeypatch, caplog):
    """Rows of one causal sequence each (no packing, no padding: long single samples) need no mask: SDPA's causal
    kernel (flash attention on CUDA), not flex, no notice, and the SDPA model's logprobs."""
    ref, ours = _pair("llama3", torch.float64)
    monkeypatch.setattr(flex, "kernel", lambda device: pytest.fail("flex ran"))
    ids = torch.randint(3, 120, (2, 50))
    pos = torch.arange(50).expand(2, 50)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="tidal.trainer"):
        b = forward_logprobs(ours, ids, pos)
        a = forward_logprobs(ref, ids, pos)
    torch.testing.assert_close(b, a, rtol=0, atol=1e-10)
    assert not [r for r in caplog.records if "attention flex" in r.getMessage()]


def test_generation_with_a_kv_cache_takes_the_dense_path():
    """A KV cache (query length 1 against the cached keys) is no training shape: the mask is SDPA's and the call
    dense; greedy generation gives the SDPA model's tokens."""
    ref, ours = _pair("qwen3", torch.float64)
    ids = torch.randint(3, 120, (1, 9))
    with torch.no_grad():
        a = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        b = ours.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)


def test_auto_chooses_per_device_and_flex_on_cpu_is_refused(caplog):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose("auto", cpu) == "per_sample" and choose("auto", cuda) == "flex"
    assert choose("auto", cuda, vision=True) == "per_sample"
    assert choose("dense", cpu) == "dense" and choose("per_sample", cuda) == "per_sample"
    with pytest.raises(ValueError, match="flex.*CPU"):
        choose("flex", cpu)
    with caplog.at_level(logging.INFO, logger="tidal.trainer"):
        assert implementation("dense", cpu) == "sdpa"
    assert any("all T² scores" in r.getMessage() for r in caplog.records)


def test_train_attention_key_reaches_the_model(tmp_path):
    """train `attention` decides the model's attention implementation; `flex` on CPU is a config error naming
    the key (exit 2)."""
    from tests.archs import build
    from tidal.config.load import ConfigError
    from tidal.config.train import TrainConfig
    from tidal.trainer.model.load import load_policy

    path = str(build("llama3", tmp_path / "m"))
    for kind, impl in (("auto", "tidal_packed_sdpa"), ("dense", "sdpa"), ("per_sample", "tidal_packed_sdpa")):
        model, _ = load_policy(TrainConfig(model=path, device="cpu", attention=kind))
        assert model.config._attn_implementation == impl, kind
    with pytest.raises(ConfigError, match="train attention 'flex' needs CUDA"):
        load_policy(TrainConfig(model=path, device="cpu", attention="flex"))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("share", [False, True])
def test_compiled_flex_equals_dense_on_cuda_bf16(share):
    """On CUDA the compiled flex kernel (bfloat16) gives the dense-mask SDPA's outputs and q/k/v gradients within
    bfloat16 rounding, on a 2 x 2,000-token packed layout (shared prompts or not) with GQA."""
    rng = np.random.default_rng()
    dev = torch.device("cuda")
    if share:
        pos = pack(group_batch(rng, prompts=12, group=8, completion=(20, 200), prompt=(50, 400)), 2000, 2,
                   share_prompts=True)[0].position_ids.to(dev)
    else:
        pos = packed_positions(rng, 2, 2000, pad=True).to(dev)
    batch, width = pos.shape
    dense = layout_mask(pos) if share else layout_mask_unshared(pos.cpu())[:, None].to(dev)
    block = flex.layout_block_mask(pos, batch) if share else None
    if block is None:
        from transformers.masking_utils import create_causal_mask

        cfg = config_for("qwen3")
        cfg._attn_implementation = register("flex")
        block = create_causal_mask(config=cfg, inputs_embeds=torch.zeros(batch, width, 8, device=dev),
                                   attention_mask=None, past_key_values=None, position_ids=pos)
    grads = []
    for mask, fn in ((block, flex_packed_attention), (dense, None)):
        torch.manual_seed(0)
        q = torch.randn(batch, 16, width, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(batch, 8, width, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(batch, 8, width, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
        if fn is not None:
            out, _ = fn(_Module(), q, k, v, mask, scaling=128 ** -0.5, position_ids=pos)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            out = out.transpose(1, 2)
        (out.float() * torch.linspace(-1, 1, out.numel(), device=dev).view_as(out)).sum().backward()
        grads.append([out.detach().float(), *(t.grad.float() for t in (q, k, v))])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@needs_cuda
def test_flex_train_step_on_cuda_matches_dense(tmp_path):
    """A LoRA GRPO step on CUDA (bfloat16) with `attention: flex` and `dense`: the same loss and gradient norm within
    bfloat16 rounding."""
    from tests.archs import build
    from tidal.config.train import TrainConfig
    from tidal.trainer.grpo import train_step
    from tidal.trainer.model.load import load_policy
    from tidal.trainer.step.optim import make_optimizer

    path = build("qwen3", tmp_path / "m")
    batch = group_batch(np.random.default_rng(0), prompts=4, group=4)
    out = {}
    for kind in ("flex", "dense"):
        torch.manual_seed(0)
        cfg = TrainConfig(model=str(path), device="cuda", attention=kind, sequence_len=256,
                          per_device_train_batch_size=2)
        model, device = load_policy(cfg)
        out[kind] = train_step(model, make_optimizer(model, cfg), batch, cfg, device, pad_id=0)
    assert abs(out["flex"]["loss"] - out["dense"]["loss"]) <= 2e-2 * max(abs(out["dense"]["loss"]), 1e-3)
