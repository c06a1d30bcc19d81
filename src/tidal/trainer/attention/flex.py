"""flex_attention on packed rows (train `attention: flex`, the CUDA default): a block-sparse kernel that skips every
128 x 128 tile of scores no query of it may see.

A packed row of 16 samples of 1,024 tokens needs 16 x 1024² / 2 scores; SDPA with a dense (T, T) mask computes all
16,384², and a per-sample loop pays one kernel launch per sample and layer. `torch.nn.attention.flex_attention`
takes a `BlockMask` (which tiles are empty, full or partial, plus a `mask_mod` for the partial ones) and visits
only the tiles the layout needs: measured on an H100 for one layer forward + backward at 16 x 1k tokens, 1.14 ms
against 25.7 ms dense and 5.0 ms per sample (issue 27).

Where the block mask comes from:
- Rows without shared prompts: transformers builds the mask itself (its causal + packed-sequence rule read from
  the restarting `position_ids`, a 2D padding mask, a sliding window for windowed layers) and hands it to the
  mask function registered for this attention, `flex_mask`, which turns that same rule into a `BlockMask` instead
  of a dense boolean tensor. The truth of the mask is transformers' rule; only its representation changes.
- Rows with shared prompts: the trainer hands a flex model the layout's `BlockMask` itself
  (`MicroBatch.mask_for` -> `layout_block_mask`, from the layout's per-token tensors `layout.token_layout`, the
  rule `layout.layout_mask` evaluates densely), which transformers passes unchanged: no T x T tensor anywhere.
  Given the dense (B, 1, T, T) layout mask instead, `flex_packed_attention` checks once per forward that it is
  exactly the layout of `position_ids` (one comparison on the device) and builds the same `BlockMask`; a 4D mask
  that is not the layout goes to the dense fallback.

Shape buckets: the sequence is padded to `bucket(T)` (a multiple of 128, at most 1/8 above T) so that the compiled
kernel (`torch.compile(flex_attention)`, once per shape on CUDA) sees few distinct shapes across micro-batches;
padded queries attend to themselves only, and no real query sees a padded key. The outputs of the padded
columns are dropped.

Rows that each hold one causal sequence (no packing, no padding: the long-sample case) need no mask at all:
`flex_mask` returns None and the call goes to SDPA's causal kernel (flash attention on CUDA), as before.

Not for flex (the call goes to transformers' SDPA with the dense mask, and a one-line notice says why, once):
attention dropout in training, soft-capped logits (Gemma 2), a KV cache (query length != key length), a 4D mask
that is not the layout. CPU: torch's flex_attention has no backward there (torch 2.13), so `attention: flex`
is refused on CPU (`tidal.trainer.attention.implementation`); its eager forward still runs on CPU, which is how
the float64 equivalence tests check the masks.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from tidal.trainer.attention.layout import layout, spans_mask, token_layout

log = logging.getLogger("tidal.trainer")

NAME = "tidal_flex"
"""The name under which `tidal.trainer.attention.register` makes `flex_packed_attention` known to transformers."""
BLOCK = 128
"""flex_attention's tile (its default `BLOCK_SIZE`); bucket sizes are multiples of it."""


def bucket(n: int) -> int:
    """The padded length for `n` tokens: a multiple of `BLOCK` and of 1/8 of the largest power of two <= n, so
    at most 12.5% (or one tile) of padding and about 8 shapes per doubling of the length."""
    step = max(BLOCK, (1 << max(n, 1).bit_length() - 1) // 8)
    step = -(-step // BLOCK) * BLOCK
    return -(-n // step) * step


def _padded(mask_mod: Any, n: int) -> Any:
    """`mask_mod` over [0, n) x [0, n), extended to a padded square: a padded query sees only itself."""

    def mod(b: Any, h: Any, q: Any, k: Any) -> Any:
        inside = (q < n) & (k < n)
        return torch.where(inside, mask_mod(b, h, q.clamp(max=n - 1), k.clamp(max=n - 1)), q == k)

    return mod


def _block_mask(mask_mod: Any, batch: int, n: int, device: torch.device) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    size = bucket(n)
    return create_block_mask(_padded(mask_mod, n), batch, None, size, size, device=device,
                             _compile=device.type == "cuda")  # compiled: no (T, T) tensor while building it


def flex_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
              mask_function: Any = None, attention_mask: torch.Tensor | None = None,
              device: torch.device | str = "cpu", **kwargs: Any) -> Any:
    """transformers' mask interface for `NAME`: the rule transformers composed (`mask_function`, with a 2D padding
    mask and offsets as transformers' own flex mask adds them) as a `BlockMask` padded to `bucket(kv_length)`
    (query and key lengths equal: training); None for one causal sequence per row (SDPA's causal kernel needs
    no mask); a dense boolean mask otherwise (`sdpa_mask`)."""
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        padding_mask_function,
        prepare_padding_mask,
        sdpa_mask,
    )

    mask_function = mask_function or causal_mask_function
    if q_length != kv_length or q_offset or kv_offset:
        kwargs.pop("allow_is_causal_skip", None)
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                         device=device, allow_is_causal_skip=False, **kwargs)
    padded = attention_mask is not None and not bool(attention_mask.all())
    if mask_function is causal_mask_function and not padded and kwargs.get("allow_is_causal_skip", True):
        return None  # one causal sequence per row: SDPA's causal (flash) kernel, no mask needed
    if padded:
        assert attention_mask is not None
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        assert padding is not None
        mask_function = and_masks(mask_function, padding_mask_function(padding))
    return _block_mask(mask_function, batch_size, q_length, torch.device(device))


def layout_block_mask(position_ids: torch.Tensor, batch: int) -> Any:
    """The `BlockMask` of `position_ids`' layout (shared prompts included; `layout.token_layout`'s rule)."""
    rows = layout(position_ids)
    if len(rows) == 1:
        rows = rows * batch
    width, device = position_ids.shape[1], position_ids.device
    seg, start, length = token_layout(rows, width, device)  # (B, T) each
    end = start + length

    def mod(b: Any, h: Any, q: Any, k: Any) -> Any:
        return ((seg[b, q] == seg[b, k]) & (k <= q)) | ((k >= start[b, q]) & (k < end[b, q]))

    return _block_mask(mod, batch, width, device)


_LAST: list[Any] = [None, None, None]
"""The last (attention_mask, position_ids, BlockMask or None) seen: every layer of a forward gets the same two
tensors, so the check of a 4D mask and its block mask are worked out once per forward (and reused by the
recompute of gradient checkpointing)."""


def _from_dense(attention_mask: torch.Tensor, position_ids: Any, batch: int, width: int) -> Any:
    """The layout's `BlockMask` when the (B, 1, T, T) bool `attention_mask` is exactly the layout of
    `position_ids`; None otherwise."""
    if _LAST[0] is attention_mask and _LAST[1] is position_ids:
        return _LAST[2]
    found = None
    if (attention_mask.dtype == torch.bool and attention_mask.shape[-2:] == (width, width)
            and isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2
            and position_ids.shape[0] in (1, batch) and position_ids.shape[1] == width):
        rows = layout(position_ids)
        expected = spans_mask(rows, width, attention_mask.device)  # (rows, T, T)
        if torch.equal(attention_mask[:, 0].expand(batch, width, width), expected.expand(batch, width, width)):
            found = layout_block_mask(position_ids, batch)
    _LAST[:] = [attention_mask, position_ids, found]
    return found


_KERNEL: dict[str, Any] = {}


def kernel(device: torch.device) -> Any:
    """flex_attention for `device`: compiled on CUDA (the fused Triton kernel; once per shape bucket), eager
    elsewhere (a reference implementation, forward only on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if "cuda" not in _KERNEL:
        import torch._dynamo.config as dynamo

        # one compiled graph per (rows, bucket) shape: allow more than dynamo's default 8 before it gives up
        dynamo.cache_size_limit = max(dynamo.cache_size_limit, 64)
        _KERNEL["cuda"] = torch.compile(flex_attention, dynamic=False)
    return _KERNEL["cuda"]


_NOTICED: set[str] = set()


def _dense_fallback(why: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    from torch.nn.attention.flex_attention import BlockMask, create_mask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if why not in _NOTICED:
        _NOTICED.add(why)
        log.info("attention flex: %s, so SDPA with a dense mask computes these calls", why)
    if isinstance(attention_mask, BlockMask):  # the same rule, as the (B, 1, T, S) bool tensor SDPA reads
        size = attention_mask.seq_lengths
        dense = create_mask(attention_mask.mask_mod, query.shape[0], 1, size[0], size[1], device=query.device)
        attention_mask = dense[:, :, :query.shape[2], :key.shape[2]]
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)  # type: ignore[no-any-return]


def flex_packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                          sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface: (B, Hq, T, D) query, (B, Hkv, T, D) key/value -> (B, T, Hq, D) output
    through flex_attention and the block mask of the row layout (module doc); otherwise the dense fallback."""
    from torch.nn.attention.flex_attention import BlockMask

    rest = dict(dropout=dropout, scaling=scaling, sliding_window=sliding_window, **kwargs)
    batch, width = query.shape[0], query.shape[2]
    softcap = kwargs.get("softcap") or getattr(getattr(module, "config", None), "attn_logit_softcapping", None)
    if dropout > 0 or softcap or key.shape[2] != width:
        why = ("attention dropout" if dropout > 0 else "soft-capped attention logits" if softcap
               else "query and key lengths differ (a KV cache)")
        return _dense_fallback(why, module, query, key, value, attention_mask, **rest)
    block = attention_mask if isinstance(attention_mask, BlockMask) else None
    if block is None and isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        block = _from_dense(attention_mask, kwargs.get("position_ids"), batch, width)
        if block is None:
            return _dense_fallback("a 4D attention mask that is not the packed layout", module, query, key, value,
                                   attention_mask, **rest)
    if block is None and attention_mask is None and getattr(module, "is_causal", True):
        # one causal sequence per row (a long single sample): SDPA's causal flash kernel is as fast as it gets
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, None, **rest)  # type: ignore[no-any-return]
    if block is None:
        return _dense_fallback("no block mask", module, query, key, value, attention_mask, **rest)
    pad = block.seq_lengths[0] - width  # (0, 0) on D, (0, pad) on T: zero keys no real query sees
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value)) if pad else (query, key, value)
    out = kernel(query.device)(q, k, v, block_mask=block, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out[:, :, :width].transpose(1, 2), None  # (B, T, Hq, D)
