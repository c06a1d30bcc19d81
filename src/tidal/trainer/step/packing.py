"""Pack a TrainingBatch's samples into rows of at most `sequence_len` tokens, grouped into micro-batches.

First-fit decreasing: samples sorted by length go into the first row with room. A sample never spans two
rows. Within a row every sample restarts its `position_ids` at 0, which makes transformers apply a
block-diagonal causal mask: no token attends across samples. Each micro-batch is padded only to its longest
row (not to `sequence_len`), so padding stays small. Padding tokens get their own position run and
`loss_mask` 0. Micro-batches take `per_device_train_batch_size` rows each, or (train `micro_batch_tokens`,
dynamic batching) as many rows as fit a token budget, counting padding: equal work per micro-batch whether the
rows hold one long sample or many short ones. A batch with images (`TrainingBatch.has_images`) adds each
micro-batch's `prompt_mask` and `image_ids` (its samples' images in row-major placeholder order); the trainer
turns them into `images` (`tidal.trainer.model.vision.ImageInputs`).

One sample per row (`one_per_row`): a model with linear-attention layers (Qwen3.5's gated-delta-net:
`tidal.models.families.packing_rule`) carries a recurrent state and a convolution window along the row, and
transformers' torch path of those layers ignores the samples' position restarts, so packed neighbours would leak
into each other; such a model gets every sample in a row of its own (right-padded: causal, so padding never
reaches a sample's tokens), and no shared prompts.

Shared prompts (`share_prompts`, train `prompt_sharing`): the completions of a GRPO group repeat one prompt, and
on short completions most of a row is prompt (the bundled example: 56 of 72 tokens). Samples whose tokens before
their first loss token are identical (one group's prompt; the same prompt drawn twice too) are packed as one
*unit*: the prompt's first p-1 tokens once (positions 0..p-2), then for each sample its tokens from p-1 on (the
prompt's last token again, then the completion) with positions p-1.. — so every token keeps the position it has
in its own sample, and the standard alignment holds (a token's logprob comes from the column before it: a
completion's first token from the repeated last prompt token). Each such suffix attends to the p-1 shared tokens
and causally to itself (`tidal.trainer.model.attention.layout_mask`, which the micro-batch carries as its 4D
`attention_mask`); the forward is the unshared one's, token for token, and the prompt's gradient is the sum of
what each completion sends it. A unit longer than `sequence_len` is cut into several, each with its own copy of
the prompt. The shared tokens count as the unit's first sample (`seq_ids`); they carry no loss.

Padding-free micro-batches (`flat`): a micro-batch of several rows is padded to its longest row, and padding runs
through every matmul of the model (on the bench-learn workload 11% of the tokens a step processes at 8 x 256 with
shared prompts, 22% at 4 x 512: bench/TRAINER-STEP.md). With `flat` each micro-batch is one row, its rows' units
laid back to back: the same samples in the same micro-batch (so the same update), no padding at all. Only for an
attention kernel whose cost does not grow with the row's width (tidal's per-sample kernel, `tidal.trainer.model.
attention.per_sample`: one SDPA call per sample whatever the row holds), and only while the flat row stays within
`FLAT_MAX_TOKENS` (the (1, 1, T, T) boolean mask transformers or `layout_mask` builds for the row is T² bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from tidal.trainer.model.attention import layout_mask, uses_flex
from tidal.trainer.model.attention.flex import layout_block_mask
from tidal.transport.batch import TrainingBatch

FLAT_MAX_TOKENS = 8192
"""The longest row `flat` packing makes (its boolean mask: 64 MiB); a longer micro-batch keeps its padded rows."""


@dataclass
class MicroBatch:
    """One forward/backward pass: (B, T) tensors; `seq_ids` is the sample index of each token (-1: pad)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    inference_logprobs: torch.Tensor
    advantages: torch.Tensor
    seq_ids: torch.Tensor
    teacher_logprobs: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    """(B, T) bool: prompt tokens (batches with images only)."""
    image_ids: torch.Tensor | None = None
    """(N,) the batch's image indices, in the order of their placeholders in the flattened rows (with images)."""
    images: Any = None
    """`tidal.trainer.model.vision.ImageInputs` of this micro-batch (set by the trainer; None: text only)."""
    routed_experts: torch.Tensor | None = None
    """(B, T, layers, top_k) int16 routes the inference engine took (-1: none; batches with routes only,
    `tidal.trainer.model.router_replay`)."""
    shared_layout: bool = False
    """Rows hold shared prompts (see the module doc): the model gets `attention_mask`."""

    @property
    def attention_mask(self) -> torch.Tensor | None:
        """(B, 1, T, T) bool, True = may attend: the layout mask of rows with shared prompts (`shared_layout`),
        built on first use on the device of `position_ids` (after `to(device)`: on a GPU, not as T² values on the
        CPU copied over: 256 MiB per 16k-token row) and kept (every layer gets the same tensor); None: the model
        builds the block-causal mask of the packed samples from `position_ids`."""
        if not self.shared_layout:
            return None
        mask = self.__dict__.get("_layout_mask")
        if mask is None or mask.device != self.position_ids.device:
            mask = self.__dict__["_layout_mask"] = layout_mask(self.position_ids)
        return mask  # type: ignore[no-any-return]

    def mask_for(self, model: torch.nn.Module) -> Any:
        """The `attention_mask` to give `model`'s forward: with shared prompts and a model on train `attention: flex`,
        the layout as flex_attention's block mask (`tidal.trainer.model.attention.flex.layout_block_mask`, the same
        rule as
        `attention_mask`, no T x T tensor at all), built once; otherwise `attention_mask`."""
        if not (self.shared_layout and uses_flex(model)):
            return self.attention_mask
        block = self.__dict__.get("_layout_block")
        if block is None:
            block = self.__dict__["_layout_block"] = layout_block_mask(self.position_ids, self.position_ids.shape[0])
        return block

    def to(self, device: torch.device) -> MicroBatch:
        moved: dict[str, Any] = {f.name: v if v is None or isinstance(v, bool) else v.to(device)
                                 for f in fields(self) for v in [getattr(self, f.name)]}
        return MicroBatch(**moved)

    @property
    def num_tokens(self) -> int:
        return int((self.seq_ids >= 0).sum())


def assign_rows(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """First-fit decreasing bin packing of sample indices into rows holding at most `capacity` tokens."""
    too_long = [int(i) for i in np.nonzero(lengths > capacity)[0]]
    if too_long:
        raise ValueError(f"sample(s) {too_long[:5]} are longer ({int(lengths.max())} tokens) than train "
                         f"sequence_len ({capacity}); raise sequence_len or lower orch seq_len")
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-int(lengths[j]), j)):
        n = int(lengths[i])
        for r, free in enumerate(room):
            if free >= n:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(capacity - n)
    return rows


def group_rows(row_lengths: list[int], rows_per_micro_batch: int, max_tokens: int | None = None) -> list[list[int]]:
    """Row indices of each micro-batch: `rows_per_micro_batch` rows at a time, or, with `max_tokens` (train
    `micro_batch_tokens`), consecutive rows while rows x longest row (the padded size) stays within the budget."""
    if max_tokens is None:
        return [list(range(s, min(s + rows_per_micro_batch, len(row_lengths))))
                for s in range(0, len(row_lengths), rows_per_micro_batch)]
    groups: list[list[int]] = []
    width = 0
    for r, n in enumerate(row_lengths):
        if groups and (len(groups[-1]) + 1) * max(width, n) <= max_tokens:
            groups[-1].append(r)
            width = max(width, n)
        else:
            groups.append([r])
            width = n
    return groups


@dataclass(frozen=True)
class Unit:
    """Samples packed together: `shared` leading tokens of `samples[0]` once, then each sample from `shared` on."""

    samples: tuple[int, ...]
    shared: int
    length: int


def _prompt_ends(batch: TrainingBatch) -> list[int]:
    """Per sample the index of its first loss token (its length when it has none)."""
    out = []
    for s in batch.samples():
        hits = np.flatnonzero(batch.loss_mask[s])
        out.append(int(hits[0]) if hits.size else int(s.stop - s.start))
    return out


def units(batch: TrainingBatch, capacity: int, share_prompts: bool) -> list[Unit]:
    """The batch's packing units (see the module doc): with `share_prompts`, samples with the same tokens before
    their first loss token (at least two such tokens, and a completion after them) share all but the last of
    them, as many per unit as fit `capacity`; every other sample is a unit of its own."""
    lengths = [int(n) for n in batch.lengths]
    if not share_prompts:
        return [Unit((i,), 0, n) for i, n in enumerate(lengths)]
    spans, ends = batch.samples(), _prompt_ends(batch)
    by_prompt: dict[bytes | int, list[int]] = {}  # a prompt's tokens, or (nothing to share) the sample's index
    for i, (s, end) in enumerate(zip(spans, ends, strict=True)):
        by_prompt.setdefault(batch.tokens[s][:end].tobytes() if 2 <= end < lengths[i] else i, []).append(i)
    def unit(members: list[int], shared: int) -> Unit:  # one sample alone shares nothing
        if len(members) == 1:
            return Unit((members[0],), 0, lengths[members[0]])
        return Unit(tuple(members), shared, shared + sum(lengths[i] - shared for i in members))

    out: list[Unit] = []
    for members in by_prompt.values():
        shared = ends[members[0]] - 1
        current: list[int] = []
        size = shared  # the unit's length were it to share
        for i in members:  # as many per unit as fit `capacity`
            if current and size + lengths[i] - shared > capacity:
                out.append(unit(current, shared))
                current, size = [], shared
            current.append(i)
            size += lengths[i] - shared
        out.append(unit(current, shared))
    return out


def layout(packed: list[Unit], sequence_len: int, rows_per_micro_batch: int, max_tokens: int | None,
           apart: list[bool] | None = None, one_per_row: bool = False,
           flat: bool = False) -> list[list[list[Unit]]]:
    """The micro-batches (each a list of rows, each a list of units) of `packed`; with `apart` (per sample), the
    units whose samples are all flagged are laid out on their own, after the others: no row or micro-batch mixes
    them (train `skip_zero_gradient` flags the samples whose loss has zero gradient). `one_per_row`: each unit in
    a row of its own (longest first). `flat`: each micro-batch's rows joined into one row (module doc) when it
    holds at most `FLAT_MAX_TOKENS` tokens."""
    classes = [packed] if apart is None else [[u for u in packed if not all(apart[i] for i in u.samples)],
                                              [u for u in packed if all(apart[i] for i in u.samples)]]
    out: list[list[list[Unit]]] = []
    for cls in (c for c in classes if c):
        rows = assign_rows(np.array([u.length for u in cls], dtype=np.int64), sequence_len)
        if one_per_row:
            rows = [[u] for row in rows for u in row]
        row_lengths = [sum(cls[u].length for u in row) for row in rows]
        for members in group_rows(row_lengths, rows_per_micro_batch, max_tokens):
            group = [[cls[u] for u in rows[r]] for r in members]
            if flat and sum(row_lengths[r] for r in members) <= FLAT_MAX_TOKENS:
                group = [[u for row in group for u in row]]
            out.append(group)
    return out


def pack(batch: TrainingBatch, sequence_len: int, rows_per_micro_batch: int, pad_id: int = 0,
         drop_truncated: bool = False, max_tokens: int | None = None,
         share_prompts: bool = False, apart: list[bool] | None = None,
         one_per_row: bool = False, flat: bool = False) -> list[MicroBatch]:
    """Pack `batch` into micro-batches of `rows_per_micro_batch` rows, or of at most `max_tokens` padded tokens
    (see module doc and `group_rows`). `drop_truncated` clears the loss mask of samples flagged `truncated`
    (mask_truncated_completions). `share_prompts`: the samples of one prompt share its tokens (module doc; text
    batches only). `apart`: per sample, those packed on their own, after the others (`layout`). `one_per_row`:
    every sample in a row of its own (models with linear-attention layers; module doc). `flat`: each
    micro-batch one row, no padding (module doc; text batches, not with `one_per_row`)."""
    if share_prompts and batch.has_images:
        raise ValueError("shared prompts are for text batches; this batch has images")
    if share_prompts and one_per_row:
        raise ValueError("shared prompts put several samples in a row; one_per_row forbids that")
    if flat and (one_per_row or batch.has_images):
        raise ValueError("flat micro-batches are for text batches packed several samples to a row")
    if int(batch.lengths.max(initial=0)) > sequence_len:
        assign_rows(batch.lengths, sequence_len)  # raises, naming the samples
    spans = batch.samples()
    teacher = batch.teacher_logprobs
    out: list[MicroBatch] = []
    for group in layout(units(batch, sequence_len, share_prompts), sequence_len, rows_per_micro_batch, max_tokens,
                        apart, one_per_row, flat):
        width = max(sum(u.length for u in row) for row in group)
        ids = np.full((len(group), width), pad_id, dtype=np.int64)
        pos = np.zeros((len(group), width), dtype=np.int64)
        mask = np.zeros((len(group), width), dtype=bool)
        inf_lp = np.zeros((len(group), width), dtype=np.float32)
        adv = np.zeros((len(group), width), dtype=np.float32)
        seq = np.full((len(group), width), -1, dtype=np.int64)
        tlp = np.zeros((len(group), width), dtype=np.float32) if teacher is not None else None
        prompt = np.zeros((len(group), width), dtype=bool) if batch.has_images else None
        routes = _route_rows(batch, len(group), width)
        images: list[int] = []
        shared_rows = False
        for r, row in enumerate(group):
            at = 0
            for unit in row:
                shared_rows |= unit.shared > 0
                for j, i in enumerate(unit.samples):
                    skip = unit.shared if j else 0  # the first sample writes the shared tokens
                    s, n = spans[i], int(batch.lengths[i]) - skip
                    part = slice(s.start + skip, s.stop)
                    ids[r, at:at + n] = batch.tokens[part]
                    pos[r, at:at + n] = np.arange(skip, skip + n)
                    assert batch.truncated is not None
                    mask[r, at:at + n] = (batch.loss_mask[part].astype(bool)
                                          & ~(drop_truncated and bool(batch.truncated[i])))
                    inf_lp[r, at:at + n] = batch.inference_logprobs[part]
                    adv[r, at:at + n] = batch.advantages[part]
                    if tlp is not None and teacher is not None:
                        tlp[r, at:at + n] = teacher[part]
                    seq[r, at:at + n] = i
                    if routes is not None and batch.routed_experts is not None:
                        routes[r, at:at + n] = _routes_of(batch.routed_experts[part])
                    if prompt is not None and batch.prompt_lengths is not None:
                        prompt[r, at:at + int(batch.prompt_lengths[i])] = True
                        images += batch.images_of(i)
                    at += n
            pos[r, at:] = np.arange(width - at)  # padding: its own run of positions
        t = [torch.from_numpy(a) for a in (ids, pos, mask, inf_lp, adv, seq)]
        mb = MicroBatch(t[0], t[1], t[2], t[3], t[4], t[5], None if tlp is None else torch.from_numpy(tlp))
        if prompt is not None:
            mb.prompt_mask, mb.image_ids = torch.from_numpy(prompt), torch.tensor(images, dtype=torch.long)
        if routes is not None:
            mb.routed_experts = torch.from_numpy(routes)
        if shared_rows:
            mb.shared_layout = True  # its `attention_mask` is built where it is used
        out.append(mb)
    return out


def _route_rows(batch: TrainingBatch, rows: int, width: int) -> np.ndarray | None:
    """(rows, width, layers, top_k) int16 routes, all -1 (no route), for a batch with routes; else None."""
    if batch.routed_experts is None:
        return None
    return np.full((rows, width, *batch.routed_experts.shape[1:]), -1, dtype=np.int16)


def _routes_of(stored: np.ndarray) -> np.ndarray:
    """A batch's stored routes as int16 with -1 for no route (uint8 marks none with 255)."""
    out = stored.astype(np.int16)
    if stored.dtype == np.uint8:
        out[stored == 255] = -1
    return out


def shared_tokens(batch: TrainingBatch, micro_batches: list[MicroBatch]) -> int:
    """Sample tokens the micro-batches did not process because a prompt was shared (0 without sharing)."""
    return int(batch.lengths.sum()) - sum(mb.num_tokens for mb in micro_batches)


def packing_efficiency(micro_batches: list[MicroBatch]) -> float:
    """Sample tokens / tokens processed (padding included)."""
    total = sum(mb.input_ids.numel() for mb in micro_batches)
    return sum(mb.num_tokens for mb in micro_batches) / max(total, 1)
