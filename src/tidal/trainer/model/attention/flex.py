"""flex_attention on packed rows (train `attention: flex`, the CUDA default): a block-sparse kernel that skips every
128 x 128 tile of scores no query of it may see, compiled into a bounded number of graphs for a whole run.

A packed row of 16 samples of 1,024 tokens needs 16 x 1024² / 2 scores; SDPA with a dense (T, T) mask computes all
16,384², and a per-sample loop pays one kernel launch per sample and layer. `torch.nn.attention.flex_attention`
takes a `BlockMask` (which tiles are empty, full or partial, plus a `mask_mod` for the partial ones) and visits
only the tiles the layout needs: measured on an H100 for one layer forward + backward at 16 x 1k tokens, 1.14 ms
against 25.7 ms dense and 5.0 ms per sample (issue 27).

tidal's own mask. Every mask this kernel runs on a packed layout is one rule over three per-token tensors: query q
may see the keys [lo[q], q] (its own sample causally, cut to a sliding window where the layer has one) and
[ps[q], pe[q]) (a shared prompt; empty otherwise). `_own_mask` builds the `BlockMask` of that rule from the tensors
alone: which tiles are empty, full or partial is counted exactly per tile (no T x T tensor, nothing compiled), and
the `mask_mod` (`_mask_mod`) captures only those three tensors. Where the rule comes from:
- Rows with shared prompts: the trainer hands a flex model the layout's mask itself (`MicroBatch.mask_for` ->
  `layout_block_mask`, from `layout.token_layout`, the rule `layout.layout_mask` evaluates densely), which
  transformers passes unchanged: no T x T tensor anywhere. Given the dense (B, 1, T, T) layout mask instead,
  `flex_packed_attention` checks once per forward that it is exactly the layout of `position_ids` (one comparison
  on the device) and builds the same mask; a 4D mask that is not the layout goes to the dense fallback.
- Rows without shared prompts: transformers composes its rule (causal, the packed samples read from the restarting
  `position_ids`, a sliding window for windowed layers) and hands it to the mask function registered for this
  attention, `flex_mask`. When that rule is exactly such a composition of transformers' own mask functions
  (`_recognized`: their code objects and captured values are read, nothing is guessed), `flex_mask` builds tidal's
  mask of the same rule; any other rule (a 2D padding mask, chunked or bidirectional attention, extra mask
  functions) keeps transformers' `mask_function` (`_foreign_mask`): correct, but compiled per row width (below).
The `BlockMask` handed to transformers is per row, padded to `bucket(T)` (a padded query sees only itself, no real
query sees a padded key); it carries the kernel's mask (`_KERNEL_MASK`) built with it.

What is compiled, and how often. `torch.compile(flex_attention, dynamic=False)` makes one graph per set of guards:
the shapes and strides of q/k/v and of every tensor of the block mask and of its `mask_mod`'s closure, every Python
value the `mask_mod` captures, grad mode and the inputs' `requires_grad`, dtype, head counts and scale. Padding the
width to a bucket alone saved nothing: the old `mask_mod`s captured the unpadded width and (B, T) tensors, and the
row count varied, so every (rows, width) compiled its own graphs. Now the kernel call (`_attend`) makes every guard
depend on the bucket only: the B rows of width T are folded into one row of B x T tokens ((B, H, T, D) ->
(1, H, B*T, D), laid out as (1, B*T, H, D): a view of the projections' memory; no query sees another row's keys,
and the tiles between rows are empty, so skipped), padded to `graph_bucket(B * T)` (4 sizes per doubling, at most
25% padding, one copy; padded queries see only themselves: one diagonal tile each); the mask's tensors are
(1, size) and (1, 1, size/128, ...); no Python number but the model's scale is captured; and a call runs either
without autograd (no grad mode, or no input needs a gradient) or with all three inputs needing one (those that did
not are detached leaves whose gradient is dropped). Hence at most `graph_budget(max_tokens)` = 2 x (number of
`graph_bucket` sizes up to `max_tokens`) graphs per attention signature (dtype, heads, head size, scale: one per
model) for a run whose micro-batches hold at most `max_tokens` tokens (rows x width): 48 for 16,384 tokens, and
with dynamic batching (train `micro_batch_tokens`) most micro-batches fall into the top few sizes. Measured on an
H200 (torch 2.11, inductor): 12 micro-batches of 4-17 rows of 462-1,842 tokens (6,860-8,005 tokens each) compiled
4 graphs; one layer forward + backward of 8 x 2,048 packed tokens took 1.12 ms folded against 1.36 ms per row.
`compiled_graphs()` counts what was compiled (the trainer logs it as `flex_graphs` in metrics.jsonl); dynamo's
recompile limit is raised to twice the promise for the largest size seen (`_reserve`); a WARNING says so once when
the count exceeds the promise (something outside the mask varies per call) and once at 75% of the limit: past the
limit dynamo stops compiling flex_attention and it runs eagerly, materialising every score in float32 (GBs per
layer). Masks not built by tidal (`_foreign_mask`) keep transformers' per-width captures and compile per row width;
they are counted too (kernel and, on CUDA, mask creation). With train `compile_layers` every decoder layer is
compiled per input shape with flex_attention inside it: those graphs are the layers' (not bounded or counted here).

Rows that each hold one causal sequence (no packing, no padding: the long-sample case) need no mask at all:
`flex_mask` returns None and the call goes to SDPA's causal kernel (flash attention on CUDA), as before.

Not for flex (the call goes to transformers' SDPA with the dense mask, and a one-line notice says why, once):
attention dropout in training, soft-capped logits (Gemma 2), a KV cache (query length != key length), a 4D mask
that is not the layout. CPU: torch's flex_attention has no backward there (torch 2.13), so `attention: flex`
is refused on CPU (`tidal.trainer.model.attention.implementation`); its eager forward still runs on CPU, which is how
the float64 equivalence tests check the masks (tests/unit/test_flex_graphs.py compiles it there with dynamo's
eager backend to count graphs: `COMPILE_ON`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from tidal.trainer.model.activations import keepable_inductor
from tidal.trainer.model.attention.layout import layout, spans_mask, token_layout

log = logging.getLogger("tidal.trainer")

NAME = "tidal_flex"
"""The name under which `tidal.trainer.model.attention.register` makes `flex_packed_attention` known to transformers."""
BLOCK = 128
"""flex_attention's tile (its default `BLOCK_SIZE`); bucket sizes are multiples of it."""
COMPILE_ON: tuple[str, ...] = ("cuda",)
"""Device types whose flex_attention is compiled (inductor on CUDA; dynamo's eager backend elsewhere, which the
graph-count test uses on CPU); other devices run torch's eager flex_attention."""
_KERNEL_MASK = "_tidal_kernel_mask"
"""Attribute of a tidal `BlockMask` (the per-row one transformers passes along): (rows, width, the folded mask
the kernel runs)."""


def bucket(n: int) -> int:
    """The padded width of a row of `n` tokens in the per-row `BlockMask` transformers passes along: a multiple of
    `BLOCK` and of 1/8 of the largest power of two <= n (at most 12.5% or one tile of padding)."""
    step = max(BLOCK, (1 << max(n, 1).bit_length() - 1) // 8)
    step = -(-step // BLOCK) * BLOCK
    return -(-n // step) * step


def graph_bucket(n: int) -> int:
    """The padded length of a micro-batch of `n` tokens (rows x width) folded into one row, the only length the
    compiled kernel sees: a multiple of `BLOCK` and of 1/4 of the largest power of two <= n (at most 25% padding;
    4 sizes per doubling above 512 tokens)."""
    step = max(BLOCK, (1 << max(n, 1).bit_length() - 1) // 4)
    step = -(-step // BLOCK) * BLOCK
    return -(-n // step) * step


def graph_buckets(max_tokens: int) -> list[int]:
    """Every `graph_bucket` size of micro-batches of 1 .. `max_tokens` tokens, ascending."""
    out = [graph_bucket(1)]
    while out[-1] < graph_bucket(max_tokens):
        out.append(graph_bucket(out[-1] + 1))
    return out


def graph_budget(max_tokens: int, signatures: int = 1) -> int:
    """Compiled flex graphs a run may make (the promise, module doc): 2 (with and without autograd) x the
    `graph_bucket` sizes up to `max_tokens` tokens per micro-batch (rows x width) x attention `signatures`
    (dtype, head counts, head size, scale: one per model)."""
    return 2 * len(graph_buckets(max_tokens)) * max(signatures, 1)


# ---------------------------------------------------------------------------------------------------------- masks

def _mask_mod(lo: torch.Tensor, ps: torch.Tensor, pe: torch.Tensor) -> Any:
    """The rule of tidal's masks over (rows, N) int32 tensors: query q of row b sees [lo, q] and [ps, pe). It
    captures these three tensors and nothing else (module doc: no Python number varies per micro-batch)."""

    def mod(b: Any, h: Any, q: Any, k: Any) -> Any:
        return ((k <= q) & (k >= lo[b, q])) | ((k >= ps[b, q]) & (k < pe[b, q]))

    return mod


def _cover(tile: torch.Tensor, first: torch.Tensor, last: torch.Tensor, use: torch.Tensor, nb: int) -> torch.Tensor:
    """(rows, nb, nb) counts: for each (query tile, key tile), how many queries of the query tile have key tiles
    [first, last] (per query, (rows, N); where `use` and first <= last)."""
    rows = tile.shape[0]
    w = (use & (first <= last)).to(torch.int32).flatten()
    base = (torch.arange(rows, device=tile.device)[:, None] * nb + tile) * (nb + 1)
    diff = torch.zeros(rows * nb * (nb + 1), dtype=torch.int32, device=tile.device)
    diff.index_add_(0, (base + first.clamp(0, nb)).flatten(), w)
    diff.index_add_(0, (base + (last + 1).clamp(0, nb)).flatten(), -w)
    return diff.view(rows, nb, nb + 1).cumsum(-1)[..., :nb]


def _ordered(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, nb, nb) bool -> flex's (rows, 1, nb) counts and (rows, 1, nb, nb) ascending indices of the Trues."""
    num = m.sum(-1, dtype=torch.int32)
    idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[:, None], idx[:, None]


def _own_mask(lo: torch.Tensor, ps: torch.Tensor, pe: torch.Tensor) -> Any:
    """The `BlockMask` of `_mask_mod(lo, ps, pe)` ((rows, N) int32, N a multiple of `BLOCK`, lo <= q): a tile is
    empty, full or partial by exact count, from per-query intervals (no (N, N) tensor, nothing compiled)."""
    from torch.nn.attention.flex_attention import BlockMask

    rows, n = lo.shape
    nb = n // BLOCK
    q = torch.arange(n, device=lo.device, dtype=lo.dtype).expand(rows, n)
    has = pe > ps
    touch = has & (ps <= q + 1) & (lo <= pe)  # the two intervals meet: one interval
    a = torch.where(touch, torch.minimum(lo, ps), lo)
    z = torch.where(touch, torch.maximum(q, pe - 1), q)  # [a, z] inclusive
    two = has & ~touch  # a second, disjoint interval [ps, pe - 1]
    tile, every = q // BLOCK, torch.ones_like(has)
    seen = _cover(tile, a // BLOCK, z // BLOCK, every, nb) + _cover(tile, ps // BLOCK, (pe - 1) // BLOCK, two, nb)
    # a contiguous key tile inside the union of two disjoint, non-adjacent intervals lies inside one of them
    whole = (_cover(tile, -(-a // BLOCK), (z + 1) // BLOCK - 1, every, nb)
             + _cover(tile, -(-ps // BLOCK), pe // BLOCK - 1, two, nb))
    full = whole == BLOCK
    kv_num, kv_idx = _ordered((seen > 0) & ~full)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                    mask_mod=_mask_mod(lo, ps, pe), seq_lengths=(n, n))


def _pad_tokens(lo: torch.Tensor, ps: torch.Tensor, pe: torch.Tensor,
                size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, n) -> (rows, size) int32: the padded queries see only themselves."""
    rows, n = lo.shape
    pad = torch.arange(n, size, device=lo.device, dtype=torch.int32).expand(rows, size - n)
    none = torch.zeros_like(pad)
    return (torch.cat([lo.to(torch.int32), pad], 1), torch.cat([ps.to(torch.int32), none], 1),
            torch.cat([pe.to(torch.int32), none], 1))


def _run_starts(ids: torch.Tensor) -> torch.Tensor:
    """(B, T) ids constant over runs of columns -> the first column of each column's run."""
    col = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return torch.where(starts, col, 0).cummax(1).values


def _tidal_mask(first: torch.Tensor, ps: torch.Tensor, pe: torch.Tensor, window: int | None = None) -> Any:
    """tidal's mask of B rows of width T from per-column (B, T) long tensors: the first column of the column's own
    sample, and its prefix [ps, pe) (empty: ps == pe); `window`: a sliding window over columns (transformers'
    rule: key > query - window). Returns the per-row `BlockMask` (padded to `bucket(T)`), carrying the folded
    mask the kernel runs (`_KERNEL_MASK`, module doc)."""
    batch, width = first.shape
    lo = first
    if window is not None:
        col = torch.arange(width, device=first.device)
        lo = torch.maximum(first, col - (int(window) - 1))
    public = _own_mask(*_pad_tokens(lo, ps, pe, bucket(width)))
    total = batch * width
    off = (torch.arange(batch, device=first.device) * width)[:, None]
    lo_f, ps_f, pe_f = ((t + off).reshape(1, total) for t in (lo, ps, pe))  # row b's columns at b x width
    folded = _own_mask(*_pad_tokens(lo_f, ps_f, pe_f, graph_bucket(total)))
    setattr(public, _KERNEL_MASK, (batch, width, folded))
    return public


def layout_block_mask(position_ids: torch.Tensor, batch: int) -> Any:
    """The `BlockMask` of `position_ids`' layout (shared prompts included; `layout.token_layout`'s rule)."""
    rows = layout(position_ids)
    if len(rows) == 1:
        rows = rows * batch
    seg, start, length = token_layout(rows, position_ids.shape[1], position_ids.device)  # (B, T) each
    return _tidal_mask(_run_starts(seg), start, start + length)


_CODES: dict[str, Any] = {}


def _codes() -> dict[str, Any]:
    """The code objects of transformers' mask-function factories (what `_recognized` matches)."""
    if not _CODES:
        from transformers import masking_utils as mu

        _CODES.update(causal=mu.causal_mask_function, all=mu.and_masks().__code__,
                      window=mu.sliding_window_overlay(1).__code__,
                      packed=mu.packed_sequence_mask_function(torch.zeros(1, 1)).__code__)
    return _CODES


def _captured(fn: Any) -> dict[str, Any]:
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ()), strict=True))


def _recognized(mask_function: Any, batch: int, width: int) -> tuple[torch.Tensor | None, int | None] | None:
    """(packed-sample ids (B, T) or None, sliding window or None) when `mask_function` is exactly transformers'
    causal rule, intersected (`and_masks`) with at most one packed-sequence rule and sliding windows (what
    `create_causal_mask` / `create_sliding_window_causal_mask` compose for packed rows); None for anything else."""
    codes = _codes()
    todo, causal, packed, window = [mask_function], False, None, None
    while todo:
        fn = todo.pop()
        code = getattr(fn, "__code__", None)
        if fn is codes["causal"]:
            causal = True
        elif code is codes["all"]:
            todo += list(_captured(fn)["mask_functions"])
        elif code is codes["window"]:
            w = _captured(fn)["sliding_window"]
            if not isinstance(w, int) or w < 1:
                return None
            window = w if window is None else min(window, w)
        elif code is codes["packed"] and packed is None:
            packed = _captured(fn)["packed_sequence_mask"]
            if not (isinstance(packed, torch.Tensor) and packed.shape == (batch, width)
                    and bool((packed[:, 1:] >= packed[:, :-1]).all())):  # sorted: equal ids are one run
                return None
        else:
            return None
    return (packed, window) if causal else None


def _padded(mask_mod: Any, n: int) -> Any:
    """`mask_mod` over [0, n) x [0, n), extended to a padded square: a padded query sees only itself."""

    def mod(b: Any, h: Any, q: Any, k: Any) -> Any:
        inside = (q < n) & (k < n)
        return torch.where(inside, mask_mod(b, h, q.clamp(max=n - 1), k.clamp(max=n - 1)), q == k)

    return mod


def _foreign_mask(mask_mod: Any, batch: int, n: int, device: torch.device) -> Any:
    """A `BlockMask` of a rule tidal did not build (`flex_mask` when `_recognized` says no), padded to `bucket(n)`:
    its `mask_mod` captures n and whatever the rule captured, so it compiles per row width (module doc). On a
    compiling device the mask creation is compiled (counted): no (T, T) tensor while building it."""
    from torch.nn.attention.flex_attention import create_block_mask

    size = bucket(n)
    make = create_block_mask
    if device.type in COMPILE_ON:
        if "mask" not in _COMPILED:
            _COMPILED["mask"] = torch.compile(create_block_mask, backend=_counting(device.type), dynamic=False)
        make = _COMPILED["mask"]
    return make(_padded(mask_mod, n), batch, None, size, size, device=device)


def flex_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
              mask_function: Any = None, attention_mask: torch.Tensor | None = None,
              device: torch.device | str = "cpu", **kwargs: Any) -> Any:
    """transformers' mask interface for `NAME`: the rule transformers composed (`mask_function`, with a 2D padding
    mask and offsets as transformers' own flex mask adds them) as a `BlockMask` padded to `bucket(kv_length)`
    (query and key lengths equal: training), tidal's own where the rule is recognized (module doc); None for one
    causal sequence per row (SDPA's causal kernel needs no mask); a dense boolean mask otherwise (`sdpa_mask`)."""
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
    device = torch.device(device)
    found = None if padded else _recognized(mask_function, batch_size, q_length)
    if found is not None:
        packed, window = found
        ids = packed if packed is not None else torch.zeros(batch_size, q_length, dtype=torch.long, device=device)
        none = torch.zeros(batch_size, q_length, dtype=torch.long, device=device)
        return _tidal_mask(_run_starts(ids.to(device)), none, none, window)
    if padded:
        assert attention_mask is not None
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        assert padding is not None
        mask_function = and_masks(mask_function, padding_mask_function(padding))
    return _foreign_mask(mask_function, batch_size, q_length, device)


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


# ------------------------------------------------------------------------------------------ compiled graphs

_COMPILED: dict[str, Any] = {}
_GRAPHS = [0]
_SEEN: dict[str, Any] = {"largest": 0, "signatures": set(), "warned": set()}


def compiled_graphs() -> int:
    """Graphs compiled so far in this process for flex attention (the kernel, and the creation of masks tidal did
    not build where it is compiled); the trainer logs it as `flex_graphs`."""
    return _GRAPHS[0]


def _recompile_limit() -> int:
    import torch._dynamo.config as dynamo

    return int(getattr(dynamo, "recompile_limit", None) or dynamo.cache_size_limit)


def _promise() -> int:
    """`graph_budget` for the largest micro-batch and the attention signatures seen so far."""
    return graph_budget(max(_SEEN["largest"], 1), len(_SEEN["signatures"]))


def _reserve(size: int, signature: tuple[Any, ...]) -> None:
    """Note a kernel call of `size` folded tokens and `signature`; keep dynamo's recompile limits at twice the
    promise (room for the warnings of `_check` before dynamo gives up on flex_attention)."""
    import torch._dynamo.config as dynamo

    _SEEN["largest"] = max(_SEEN["largest"], size)
    _SEEN["signatures"].add(signature)
    need = 2 * _promise()
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(dynamo, name) and getattr(dynamo, name) < need:
            setattr(dynamo, name, need)


def _check(count: int) -> None:
    """The loud warnings (once each): more graphs than promised; 75% of dynamo's recompile limit."""
    promise, limit = _promise(), _recompile_limit()
    past = ("past it dynamo stops compiling flex_attention and runs it eagerly, materialising every attention "
            "score in float32 (GBs per layer: slow, likely out of memory)")
    if count > promise and "promise" not in _SEEN["warned"]:
        _SEEN["warned"].add("promise")
        log.warning("attention flex: %d compiled graphs, more than the %d promised for micro-batches up to %d "
                    "tokens (graph_budget): something besides the bucket, grad mode and the model varies between "
                    "calls (a mask tidal did not build? see tidal.trainer.model.attention.flex); dynamo's recompile "
                    "limit "
                    "is %d, and %s. Set TORCH_LOGS=recompiles to see which guard fails, and report it",
                    count, promise, _SEEN["largest"], limit, past)
    if count >= 0.75 * limit and "limit" not in _SEEN["warned"]:
        _SEEN["warned"].add("limit")
        log.warning("attention flex: %d compiled graphs, 75%% of dynamo's recompile limit (%d); %s. Raise "
                    "torch._dynamo.config.recompile_limit, or use train attention: per_sample/dense meanwhile",
                    count, limit, past)


def _counting(device_type: str) -> Any:
    """A dynamo backend that counts its graphs (`compiled_graphs`) and hands them to inductor on CUDA (as one region
    `checkpoint_scope: elementwise` keeps: `activations.keepable_inductor`), to dynamo's eager backend elsewhere."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = keepable_inductor if device_type == "cuda" else lookup_backend("eager")

    def backend(gm: Any, example_inputs: Any) -> Any:
        _GRAPHS[0] += 1
        log.info("attention flex: compiled graph %d (promised at most %d so far)", _GRAPHS[0], _promise())
        _check(_GRAPHS[0])
        return inner(gm, example_inputs)

    return backend


def kernel(device: torch.device) -> Any:
    """flex_attention for `device`: compiled on CUDA (the fused Triton kernel; graphs as the module doc bounds
    them, counted by `compiled_graphs`), eager elsewhere (a reference implementation, forward only on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type not in COMPILE_ON:
        return flex_attention
    if device.type not in _COMPILED:
        _COMPILED[device.type] = torch.compile(flex_attention, backend=_counting(device.type), dynamic=False)
    return _COMPILED[device.type]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Any, scale: float | None,
            gqa: bool) -> torch.Tensor:
    """The kernel call: with autograd only when an input needs a gradient, and then for all three (module doc:
    the two grad variants the promise counts)."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if grad:
        q, k, v = (t if t.requires_grad else t.detach().requires_grad_() for t in (q, k, v))
    if q.device.type in COMPILE_ON and not torch.compiler.is_compiling():
        _reserve(q.shape[2], (q.dtype, q.shape[1], k.shape[1], q.shape[3], scale, q.device.type))
    with torch.set_grad_enabled(grad):
        return kernel(q.device)(q, k, v, block_mask=block, scale=scale, enable_gqa=gqa)  # type: ignore[no-any-return]


def _fold(t: torch.Tensor, size: int) -> torch.Tensor:
    """(B, H, T, D) -> (1, H, size, D): the rows one after another, then zeros; always laid out as (1, size, H, D)
    (the strides are guarded too). Without padding it is a view of the projections' (B, T, H, D) memory, which is
    how transformers hands q/k/v over; with it, one copy."""
    b, h, w, d = t.shape
    flat = t.transpose(1, 2).reshape(1, b * w, h, d)
    flat = F.pad(flat, (0, 0, 0, 0, 0, size - b * w)) if size > b * w else flat.contiguous()
    return flat.transpose(1, 2)


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
    gqa = query.shape[1] != key.shape[1]
    own = getattr(block, _KERNEL_MASK, None)
    if own is not None and own[:2] == (batch, width):  # tidal's mask: the rows folded into one (module doc)
        folded = own[2]
        size = folded.seq_lengths[0]
        out = _attend(_fold(query, size), _fold(key, size), _fold(value, size), folded, scaling, gqa)
        out = out[0, :, :batch * width].transpose(0, 1)  # (B x T, Hq, D)
        return out.reshape(batch, width, *out.shape[1:]), None  # (B, T, Hq, D)
    pad = block.seq_lengths[0] - width  # (0, 0) on D, (0, pad) on T: zero keys no real query sees
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value)) if pad else (query, key, value)
    out = _attend(q, k, v, block, scaling, gqa)
    return out[:, :, :width].transpose(1, 2), None  # (B, T, Hq, D)
