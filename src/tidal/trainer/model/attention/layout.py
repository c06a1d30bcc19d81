"""The layout of a packed row, read from its `position_ids`: which columns attend to which.

The trainer packs several samples into one row (`tidal.trainer.step.packing`), each restarting its `position_ids` at 0;
a span of columns whose positions continue one another is one sample (or one padding run). With shared prompts
(train `prompt_sharing`) a span whose first position q is not 0 is a *suffix*: it continues the row's last span
that started at position 0 (its *root*) after that root's first q tokens, the shared prompt; it attends to those
q tokens and causally to itself. Every attention kernel of this package reads the same layout: the per-sample
SDPA loop (`per_sample`), flex_attention's block mask (`flex`) and the dense (B, 1, T, T) mask (`layout_mask`,
which the packer hands to the model when rows share prompts, and which SDPA reads as it is).

`token_layout` gives the layout as three per-token tensors (span id, prefix start, prefix length), from which the
dense mask is one vectorized comparison and flex's `mask_mod` one expression: the two cannot disagree.
"""

from __future__ import annotations

import torch

Span = tuple[int, int, int, int]
"""(start, end, prefix_start, prefix_len): the columns [start, end) attend causally to themselves and to all of
[prefix_start, prefix_start + prefix_len) (prefix_len 0: a sample of its own)."""


def segments(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """(B, T) position ids -> per row the [start, end) spans of its samples: a span starts at column 0 and
    wherever a position is not the previous one + 1 (a sample restarting at 0, a suffix, or a padding run)."""
    pos = position_ids.detach()
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    out = []
    width = pos.shape[1]
    for row in starts.cpu():
        idx = row.nonzero().flatten().tolist()
        out.append(list(zip(idx, [*idx[1:], width], strict=True)))
    return out


def layout(position_ids: torch.Tensor, share: bool = True) -> list[list[Span]]:
    """(B, T) position ids -> per row its `Span`s (see the module doc): a span starting at position q > 0 attends
    to the first q tokens of the row's last span that started at 0, when that span has more than q tokens (else,
    and with no such span, to itself only). `share=False`: every span attends to itself only (the block-causal
    layout transformers builds from packed position ids)."""
    first = position_ids.detach().cpu().tolist()
    rows: list[list[Span]] = []
    for spans, pos in zip(segments(position_ids), first, strict=True):
        row: list[Span] = []
        root = None
        for s, e in spans:
            q = int(pos[s])
            if q == 0:
                root = (s, e)
                row.append((s, e, s, 0))
            elif share and root is not None and root[1] - root[0] > q:
                row.append((s, e, root[0], q))
            else:
                row.append((s, e, s, 0))
        rows.append(row)
    return rows


def token_layout(rows: list[list[Span]], width: int,
                 device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token (rows, T) long tensors: the span index of each column, the first column of its prefix, and the
    prefix length (0: none). Column q may attend to column k iff (same span and k <= q) or
    prefix_start[q] <= k < prefix_start[q] + prefix_len[q]."""
    seg = torch.empty(len(rows), width, dtype=torch.long)
    start = torch.zeros(len(rows), width, dtype=torch.long)
    length = torch.zeros(len(rows), width, dtype=torch.long)
    for b, spans in enumerate(rows):
        for i, (s, e, ps, q) in enumerate(spans):
            seg[b, s:e], start[b, s:e], length[b, s:e] = i, ps, q
    return seg.to(device), start.to(device), length.to(device)


def spans_mask(rows: list[list[Span]], width: int, device: torch.device | None = None) -> torch.Tensor:
    """(rows, T, T) bool on `device`: what the spans attend to (`token_layout`'s rule, vectorized)."""
    seg, start, length = token_layout(rows, width, device)
    k = torch.arange(width, device=device)
    causal = k[None, :] <= k[:, None]  # (T, T): key <= query
    own = (seg[:, :, None] == seg[:, None, :]) & causal  # (rows, T, T)
    prefix = (k >= start[:, :, None]) & (k < (start + length)[:, :, None])  # (rows, T, T)
    return own | prefix


def layout_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) position ids -> the (B, 1, T, T) bool mask of their `layout` (True: may attend), for a model's
    `attention_mask` when rows hold shared prompts."""
    return spans_mask(layout(position_ids), position_ids.shape[1], position_ids.device)[:, None]
