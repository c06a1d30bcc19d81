"""Per-sample attention (train `attention: per_sample`, the CPU default): each sample of a packed row attends only to
its own tokens, computed sample by sample.

The trainer packs several samples into one row (`tidal.trainer.step.packing`), each restarting its `position_ids` at
0. transformers' `sdpa` attention turns that into a (B, 1, T, T) block-diagonal causal mask, and a kernel given
a mask computes all T x T scores: on a 512-token row of four 120-token samples, 4.5x the work the samples need
(and the causal half is not skipped either). `packed_sdpa_attention` (registered with transformers as
`NAME`) reads the sample boundaries from `position_ids` (a new sample wherever the position does not
continue the previous one) and runs `torch.nn.functional.scaled_dot_product_attention` with `is_causal=True` on
each sample's query/key/value slice — Σ len² / 2 scores, the causal-kernel path — then concatenates the outputs
(split and concatenate, so the backward moves each gradient once). The spans and the mask check are worked out
once per forward (every layer gets the same mask and position ids). Numerically each sample sees exactly the
keys the mask allowed (tests/unit/test_packed_attention.py checks it against the masked computation in float64).

Where the per-sample path does not apply, the call is passed unchanged to transformers' own SDPA attention with the
mask transformers built (the mask interface is SDPA's): non-causal modules (vision encoders), a KV cache (query
length != key length), attention dropout in training, sliding-window layers whose window is shorter than a
sample, attention logit soft-capping, position ids that are not (B, T) or (1, T), and a mask that is not exactly
"causal within each sample" (a padding mask, say: the mask transformers built is compared with the spans' own).

On CPU the per-sample scores are computed in float32 even under bfloat16 autocast (train `recipe: bf16` on CPU,
`tidal.trainer.model.precision`): PyTorch's CPU flash-attention backward is ~3x slower in bfloat16 than in float32
(measured on the bench's shapes), and the softmax keeps float32 precision. The output is cast back to the query's
dtype.

Shared prompts (`tidal.trainer.step.packing`, train `prompt_sharing`): a span whose first position q is not 0 is a
*suffix*: it continues the row's last span that started at position 0 (its *root*) after that root's first q
tokens, the shared prompt. It attends to those q tokens and causally to itself: one SDPA call with the root's
first q keys/values put before its own and a (L, q + L) bottom-right causal mask. `layout_mask` is the same rule as
a (B, 1, T, T) mask; the packer hands it to the model as `attention_mask` (transformers passes a 4D mask through
unchanged), so the mask stays the truth: the per-sample path runs only when it equals the spans' mask, and SDPA
with that mask (GPU, or any case above) computes the same thing.

This is the CPU counterpart of flash-attention's variable-length kernels (not available on CPU); on CUDA the
default is flex_attention with a block mask of the same layout (`tidal.trainer.model.attention.flex`). The row layout
(`segments`, `layout`, `layout_mask`) lives in `tidal.trainer.model.attention.layout`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from tidal.trainer.model.attention.layout import Span, layout, spans_mask

NAME = "tidal_packed_sdpa"
"""The name under which `tidal.trainer.model.attention.register` makes `packed_sdpa_attention` known to transformers."""


def _per_sample_applies(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, dropout: float,
                        sliding_window: int | None, position_ids: Any, kwargs: dict[str, Any]) -> bool:
    if not getattr(module, "is_causal", True) or query.shape[2] != key.shape[2] or dropout > 0:
        return False
    if (not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2
            or position_ids.shape[0] not in (1, query.shape[0]) or position_ids.shape[1] != query.shape[2]):
        return False
    if kwargs.get("softcap") is not None or getattr(getattr(module, "config", None), "attn_logit_softcapping", None):
        return False
    return sliding_window is None or sliding_window >= query.shape[2]


def _mask_is_per_sample(attention_mask: torch.Tensor | None, rows: list[list[Span]], batch: int,
                        width: int) -> bool:
    """Whether the mask the model got allows exactly what the spans attend to (so the per-sample path computes
    what it would). None (transformers saw nothing to mask): only when every row is one span. A boolean
    (B or 1, 1, T, T) mask (the block-causal one transformers builds for packed rows, or `layout_mask`):
    compared with the spans' own (cheap next to the attention itself). Anything else (padding masks, additive
    float masks): no."""
    if attention_mask is None:
        return all(len(spans) == 1 for spans in rows)
    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape[-2:] != (width, width):
        return False
    expected = spans_mask(rows, width)  # (rows, T, T)
    got = attention_mask[:, 0].cpu()
    return bool(torch.equal(got.expand(batch, width, width), expected.expand(batch, width, width)))


@functools.lru_cache(maxsize=4096)
def _suffix_mask(length: int, prefix: int, device: torch.device) -> torch.Tensor:
    """(length, prefix + length) bool: every prefix key, and the suffix's own keys causally."""
    return torch.ones(length, prefix + length, dtype=torch.bool, device=device).tril(prefix)


def packed_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface: (B, Hq, T, D) query, (B, Hkv, T, D) key/value -> (B, T, Hq, D) output,
    per sample of each packed row (see the module doc); otherwise transformers' SDPA attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    rows: list[list[Span]] = []
    if _per_sample_applies(module, query, key, dropout, sliding_window, position_ids, kwargs):
        assert isinstance(position_ids, torch.Tensor)
        rows = _spans_for(attention_mask, position_ids, query.shape[0], query.shape[2])
    if not rows:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    gqa = query.shape[1] != key.shape[1]
    dt = torch.promote_types(query.dtype, torch.float32) if query.device.type == "cpu" else query.dtype  # module doc
    with torch.autocast(query.device.type, enabled=False):
        q, k, v = query.to(dt), key.to(dt), value.to(dt)  # one cast each (no-op without autocast)
        out = []
        for b, spans in enumerate(rows):  # split/cat, not slice-assign: their backward moves each gradient once
            lengths = [e - s for s, e, _, _ in spans]
            qs, ks, vs = q[b].split(lengths, 1), k[b].split(lengths, 1), v[b].split(lengths, 1)  # (H, L, D) each
            index = {s: i for i, (s, _, _, _) in enumerate(spans)}
            parts = []
            for i, (_, _, ps, n) in enumerate(spans):
                if n == 0:
                    parts.append(F.scaled_dot_product_attention(qs[i][None], ks[i][None], vs[i][None], is_causal=True,
                                                                scale=scaling, enable_gqa=gqa)[0])  # (Hq, L, D)
                    continue
                root = index[ps]  # a suffix: the root's first n keys/values, then its own
                parts.append(F.scaled_dot_product_attention(
                    qs[i][None], torch.cat([ks[root][:, :n], ks[i]], 1)[None],
                    torch.cat([vs[root][:, :n], vs[i]], 1)[None], attn_mask=_suffix_mask(lengths[i], n, q.device),
                    scale=scaling, enable_gqa=gqa)[0])
            out.append(torch.cat(parts, 1).transpose(0, 1))  # (T, Hq, D)
    return torch.stack(out).to(query.dtype), None


_LAST: list[Any] = [None, None, None]
"""The last (attention_mask, position_ids, spans) seen: every layer of a forward gets the same two tensors, so the
spans and the mask check are worked out once per forward."""


def _spans_for(attention_mask: torch.Tensor | None, position_ids: torch.Tensor, batch: int,
               width: int) -> list[list[Span]]:
    """Per row its spans when the per-sample path computes what `attention_mask` says; [] otherwise."""
    if _LAST[0] is attention_mask and _LAST[1] is position_ids and len(_LAST[2]) in (0, batch):
        return list(_LAST[2])
    rows = layout(position_ids)
    if len(rows) == 1:  # (1, T) position ids (transformers' default arange) hold for every row
        rows = rows * batch
    if not _mask_is_per_sample(attention_mask, rows, batch, width):
        rows = []
    _LAST[:] = [attention_mask, position_ids, rows]
    return rows
