"""M-RoPE positions of the Qwen-VL families for packed rows: per sample, from the model's own `get_rope_index`.

Qwen2.5-VL and Qwen3-VL rotate queries and keys by three position streams, temporal / height / width (their
`mrope_section` splits the rotary frequencies between them; Qwen3-VL interleaves the three, which its rotary
embedding does from the same three streams). A text token has the same position in all three; an image's
placeholder tokens get their (t, h, w) grid coordinates offset by the position where the image starts, and the
text after an image continues from that offset + max(h, w) / merge (not from the token count). The model's
`get_rope_index(input_ids, mm_token_type_ids, image_grid_thw)` computes this for one sequence; tidal calls it for
each packed sample on its own tokens, with `mm_token_type_ids` = the sample's prompt image placeholders (a
placeholder token the model sampled in a completion is a text token, as vLLM embeds and positions it), so each
sample's streams start at 0 in its row, as they would in that sample's own forward.

The language model then gets (4, B, T) `position_ids`: row 0 the packed rows' plain restarting positions (from
which transformers builds the block-causal mask and tidal's attention kernels read the sample boundaries), rows
1-3 the M-RoPE streams — the layout transformers' Qwen-VL text models read as "packed" (their `position_ids[0]` is
taken as the text positions). A text-only micro-batch (no image) gets its plain positions in all four rows, what
the model computes for text alone. Padding runs keep their own plain run in every row.
"""

from __future__ import annotations

from typing import Any

import torch

MROPE_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl")
"""transformers `model_type`s whose positions this module builds (tidal.trainer.model.vision.TRAINABLE's Qwen-VLs)."""
TRANSFORMERS_FLOOR = "5.3.0"
"""The first transformers whose Qwen-VL `get_rope_index` takes `mm_token_type_ids` (`sample_positions` calls it so;
5.2 and earlier take `(input_ids, image_grid_thw, ...)` and would read the image mask as the grid)."""


def check_transformers(model_type: str, version: str | None = None) -> None:
    """Raise `ConfigError` (exit 2) when a model of `model_type` takes M-RoPE positions and the installed transformers
    (`version`: transformers.__version__ unless given) is older than `TRANSFORMERS_FLOOR`."""
    if model_type not in MROPE_MODEL_TYPES:
        return
    import transformers
    from packaging.version import Version

    from tidal.config.load import ConfigError

    have = version or transformers.__version__
    if Version(have) < Version(TRANSFORMERS_FLOOR):
        raise ConfigError(f"train model: a {model_type} model needs transformers>={TRANSFORMERS_FLOOR} (its M-RoPE "
                          f"positions call get_rope_index(input_ids, mm_token_type_ids=...), new in "
                          f"{TRANSFORMERS_FLOOR}); this environment has transformers {have}: pip install "
                          f"'transformers>={TRANSFORMERS_FLOOR}'")


def uses_mrope(base: Any) -> bool:
    """Whether a (PEFT-unwrapped) transformers model takes M-RoPE positions built here."""
    return getattr(getattr(base, "config", None), "model_type", None) in MROPE_MODEL_TYPES


def _runs(mask: torch.Tensor) -> list[int]:
    """(L,) bool -> the lengths of its runs of True, in order."""
    m = torch.nn.functional.pad(mask.long(), (1, 1))
    edges = (m[1:] - m[:-1]).nonzero().flatten().tolist()  # start, end, start, end, ...
    return [e - s for s, e in zip(edges[::2], edges[1::2], strict=True)]


def sample_positions(base: Any, ids: torch.Tensor, image_mask: torch.Tensor, grids: list[torch.Tensor]) -> torch.Tensor:
    """One sample's (3, L) M-RoPE positions: `ids` (L,), `image_mask` (L,) its prompt image placeholders, `grids`
    its images' (1, 3) `image_grid_thw` in placeholder order. Each image must be one run of placeholder tokens of
    t·h·w / merge² tokens (else ValueError: the tokens and the processor's grids disagree)."""
    merge = int(base.config.vision_config.spatial_merge_size)
    runs = _runs(image_mask)
    sizes = [int(g.prod()) // merge**2 for g in grids]
    if runs != sizes:
        raise ValueError(f"a sample's image placeholder runs have {runs} tokens but its {len(grids)} image(s) give "
                         f"{sizes} (image_grid_thw {[g.flatten().tolist() for g in grids]}, merge {merge}): each "
                         "image must be one run of its own placeholders, as the model's processor expands them")
    thw = torch.cat(grids).to(ids.device) if grids else None
    pos, _ = base.model.get_rope_index(ids[None], mm_token_type_ids=image_mask[None].int(), image_grid_thw=thw)
    return pos[:, 0]  # type: ignore[no-any-return]  # (3, L)


def packed_positions(base: Any, input_ids: torch.Tensor, position_ids: torch.Tensor, seq_ids: torch.Tensor,
                     image_mask: torch.Tensor, grids: dict[int, list[torch.Tensor]]) -> torch.Tensor:
    """(B, T) packed rows -> (3, B, T) M-RoPE positions, per sample (`sample_positions`) with its own images:
    `seq_ids` (B, T) each token's sample (-1: padding), `image_mask` (B, T) the prompt placeholders, `grids` per
    sample index its images' (1, 3) grids in placeholder order (none: text only). Padding keeps its plain
    positions."""
    out = position_ids[None].expand(3, -1, -1).clone()  # (3, B, T)
    for r in range(input_ids.shape[0]):
        seq = seq_ids[r]
        change = torch.ones_like(seq, dtype=torch.bool)
        change[1:] = seq[1:] != seq[:-1]
        starts = change.nonzero().flatten().tolist()
        for s, e in zip(starts, [*starts[1:], seq.shape[0]], strict=True):
            i = int(seq[s])
            if i >= 0:
                out[:, r, s:e] = sample_positions(base, input_ids[r, s:e], image_mask[r, s:e], grids.get(i, []))
    return out


def with_text_row(position_ids: torch.Tensor, mrope: torch.Tensor | None) -> torch.Tensor:
    """(B, T) plain positions and (3, B, T) M-RoPE ones (None: text only, plain in every row) -> (4, B, T)."""
    streams = position_ids[None].expand(3, -1, -1) if mrope is None else mrope.to(position_ids.device)
    return torch.cat([position_ids[None], streams])
