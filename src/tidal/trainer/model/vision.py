"""Vision-language models in the trainer: a batch's images -> pixel tensors -> input embeddings.

A batch whose prompts hold images (`TrainingBatch.has_images`) carries each image as PNG bytes. Per micro-batch,
`image_inputs` runs the model's own Hugging Face image processor (from its directory, as vLLM does) on each
image the micro-batch's rows hold, in placeholder order. `embed` then builds the (B, T, H) input embeddings the
way vLLM does: the token embeddings, with the image features (vision tower + projector) written over the
prompt's image placeholder tokens. Only the prompt's: a placeholder token that the model itself sampled in a
completion is embedded as a plain token, as vLLM embeds it during decoding (the model's own `forward` would
try to put image features there too). The language model then runs on `inputs_embeds`.

Which families (`TRAINABLE`): those whose `get_image_features(**processor tensors).pooler_output` gives one row
per placeholder token. Idefics3 (SmolVLM's architecture too) takes plain 1-D positions. Qwen2.5-VL and Qwen3-VL
(the processor's `pixel_values` (patches, C·T·P·P) and `image_grid_thw` (1, 3) per image) take M-RoPE positions,
built per packed sample by `tidal.trainer.model.mrope` when the images are attached (`ImageInputs.mrope`), and
handed to the model as (4, B, T) `position_ids` (`model_inputs`). Qwen3-VL also adds its vision tower's
*deepstack* features (`deepstack_features`, one (tokens, H) per listed vision layer) to the hidden states of its
first decoder layers at the placeholders; the model's own forward derives where from `input_ids` (every image
token), so tidal passes them to its language model with a forward pre-hook, on the prompt placeholders only.
Each family is checked against the Hugging Face model's own forward per sample (tests/unit/test_vlm.py,
test_qwen_vl.py); vLLM serving Qwen-VL needs torchvision (docs/vlm.md).
"""

from __future__ import annotations

import contextlib
import functools
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tidal.models.families import TEXT_PATH_VLMS
from tidal.models.lora import VISION_MODULES
from tidal.trainer.model.mrope import packed_positions, uses_mrope, with_text_row
from tidal.transport.batch import TrainingBatch

__all__ = ["TRAINABLE", "VISION_MODULES", "ImageInputs", "NotAVisionModel", "attach_images", "embed", "model_inputs"]

TRAINABLE = ("Idefics3ForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
             "Qwen3VLForConditionalGeneration")
"""Vision-language architectures whose image inputs tidal's trainer builds (see the module doc)."""



class NotAVisionModel(ValueError):
    """A batch holds images but the trained model takes text only."""


@dataclass
class ImageInputs:
    """The images of one micro-batch."""

    mask: torch.Tensor
    """(B, T) bool: the prompt image placeholder tokens, whose embeddings the image features replace."""
    pixels: list[dict[str, torch.Tensor]]
    """Per image, in placeholder order (row-major over the micro-batch): the image processor's tensors."""
    mrope: torch.Tensor | None = None
    """(3, B, T) M-RoPE positions of the Qwen-VL families (`tidal.trainer.model.mrope`); None: plain positions."""

    def to(self, device: torch.device) -> ImageInputs:
        return ImageInputs(self.mask.to(device), [{k: v.to(device) for k, v in px.items()} for px in self.pixels],
                           None if self.mrope is None else self.mrope.to(device))


def is_vision_config(config: Any) -> bool:
    """Whether a transformers config is a vision-language model's (it has a vision tower)."""
    return getattr(config, "vision_config", None) is not None


def _base(model: torch.nn.Module) -> Any:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def check_trainable(model: torch.nn.Module, model_name: str) -> None:
    """Raise NotAVisionModel / ValueError unless `model` is a VLM whose image inputs tidal builds."""
    base = _base(model)
    arch = type(base).__name__
    if not is_vision_config(getattr(base, "config", None)):
        raise NotAVisionModel(f"the batch's prompts hold images, but train model '{model_name}' ({arch}) is a "
                              "text-only model; use a vision-language model or text prompts")
    if arch not in TRAINABLE:
        raise ValueError(f"train model '{model_name}' is a {arch}; tidal's trainer builds image inputs for "
                         f"{', '.join(TRAINABLE)} (see docs/vlm.md)"
                         + ("; this one trains and serves on its text path only: give text prompts"
                            if arch in TEXT_PATH_VLMS else ""))


@functools.cache
def image_processor(model_dir: str, trust_remote_code: bool = False) -> Any:
    """The model directory's image processor (its `preprocessor_config.json`), loaded once per process."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(model_dir, trust_remote_code=trust_remote_code)


def pixel_tensors(processor: Any, png: bytes) -> dict[str, torch.Tensor]:
    """One image's processor tensors (e.g. Idefics3: `pixel_values` (1, tiles, 3, H, W) and
    `pixel_attention_mask` (1, tiles, H, W); Qwen-VL: `pixel_values` (patches, C·T·P·P), `image_grid_thw` (1, 3))."""
    from PIL import Image

    img = Image.open(io.BytesIO(png))
    img.load()
    out = processor(images=[[img.convert("RGB")]], return_tensors="pt")
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


def image_inputs(batch: TrainingBatch, image_ids: torch.Tensor, prompt_mask: torch.Tensor, input_ids: torch.Tensor,
                 image_token_id: int, processor: Any, cache: dict[int, dict[str, torch.Tensor]]) -> ImageInputs:
    """A micro-batch's `ImageInputs`: `image_ids` (N,) the batch's image indices in placeholder order,
    `prompt_mask` (B, T) its prompt tokens; `cache` holds the processed images of this batch by index."""
    pixels = []
    for j in image_ids.tolist():
        if j not in cache:
            cache[j] = pixel_tensors(processor, batch.image_bytes(j))
        pixels.append(cache[j])
    return ImageInputs(prompt_mask & (input_ids == image_token_id), pixels)


def image_token_id(model: torch.nn.Module) -> int:
    config = _base(model).config
    tid = getattr(config, "image_token_id", None)
    tid = getattr(config, "image_token_index", None) if tid is None else tid
    if tid is None:
        raise ValueError(f"{type(_base(model)).__name__}: the config names no image_token_id")
    return int(tid)


def _image_features(base: Any, px: dict[str, torch.Tensor], width: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One image's (tokens, H) features and (Qwen3-VL) its per-layer (tokens, H) deepstack features."""
    out = base.get_image_features(**px)
    pooled = out.pooler_output if hasattr(out, "pooler_output") else out
    if isinstance(pooled, (tuple, list)):  # Qwen-VL: split per image
        pooled = torch.cat(list(pooled))
    deep = [torch.cat(list(f)) if isinstance(f, (tuple, list)) else f
            for f in getattr(out, "deepstack_features", None) or []]
    return pooled.reshape(-1, width), deep  # (tiles * tokens per tile, H)


def _features(model: torch.nn.Module, input_ids: torch.Tensor,
              images: ImageInputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(B, T) ids -> (B, T, H) input embeddings with the image features on the prompt placeholders, and the
    deepstack features of those placeholders per layer (Qwen3-VL; else empty)."""
    emb = model.get_input_embeddings()(input_ids)  # type: ignore[operator]  # (B, T, H)
    base = _base(model)
    feats, deeps = [], []
    for px in images.pixels:
        f, d = _image_features(base, px, emb.shape[-1])
        feats.append(f)
        deeps.append(d)
    flat = torch.cat(feats).to(emb.dtype) if feats else emb.new_zeros(0, emb.shape[-1])
    slots = int(images.mask.sum())
    if flat.shape[0] != slots:
        raise ValueError(f"{len(images.pixels)} image(s) give {flat.shape[0]} feature rows but the prompts hold "
                         f"{slots} image placeholder tokens: the model's image processor does not match the "
                         "tokens vLLM expanded")
    deep = [torch.cat(layer) for layer in zip(*deeps, strict=True)] if deeps and deeps[0] else []
    return emb.masked_scatter(images.mask.unsqueeze(-1), flat), deep


def embed(model: torch.nn.Module, input_ids: torch.Tensor, images: ImageInputs) -> torch.Tensor:
    """(B, T) ids -> (B, T, H) input embeddings with the image features on the prompt placeholders."""
    return _features(model, input_ids, images)[0]


@contextlib.contextmanager
def model_inputs(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 images: ImageInputs | None) -> Iterator[dict[str, torch.Tensor]]:
    """The token and position arguments of the model's forward, valid inside the `with`: `input_ids` and
    `position_ids` for a text micro-batch; with `images`, `inputs_embeds` carrying the image features. A Qwen-VL
    model gets (4, B, T) positions (`tidal.trainer.model.mrope.with_text_row`), and Qwen3-VL's deepstack features
    reach its language model through a forward pre-hook held for the `with` (module doc)."""
    base = _base(model)
    mrope = uses_mrope(base)
    pos = with_text_row(position_ids, images.mrope if images is not None else None) if mrope else position_ids
    if images is None:
        yield {"input_ids": input_ids, "position_ids": pos}
        return
    emb, deep = _features(model, input_ids, images)
    handle = None
    if deep:
        mask = images.mask

        def deepstack(_module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            return args, {**kwargs, "visual_pos_masks": mask, "deepstack_visual_embeds": deep}

        handle = base.model.language_model.register_forward_pre_hook(deepstack, with_kwargs=True)
    try:
        yield {"inputs_embeds": emb, "position_ids": pos}
    finally:
        if handle is not None:
            handle.remove()


def attach_images(model: torch.nn.Module, batch: TrainingBatch, micro: list[Any], model_dir: str, model_name: str,
                  trust_remote_code: bool = False) -> None:
    """Set each packed micro-batch's `images` (no-op for a batch without images); each image is processed once."""
    if not batch.has_images:
        return
    check_trainable(model, model_name)
    processor = image_processor(model_dir, trust_remote_code)
    tid = image_token_id(model)
    cache: dict[int, dict[str, torch.Tensor]] = {}
    base = _base(model)
    for mb in micro:
        images = image_inputs(batch, mb.image_ids.cpu(), mb.prompt_mask, mb.input_ids, tid, processor, cache)
        if uses_mrope(base):  # Qwen-VL: per sample M-RoPE positions from its images' grids (on the CPU copy)
            samples = {int(i) for i in mb.seq_ids.unique().tolist() if i >= 0}
            grids = {i: [cache[j]["image_grid_thw"] for j in batch.images_of(i)] for i in samples}
            images.mrope = packed_positions(base, mb.input_ids.cpu(), mb.position_ids.cpu(), mb.seq_ids.cpu(),
                                            images.mask.cpu(), grids)
        mb.images = images.to(mb.input_ids.device)
