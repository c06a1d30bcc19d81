"""Images in prompts: chat content parts with images -> what vLLM is sent and what the trainer gets.

A message's `content` may be a list of parts, as in the OpenAI / Hugging Face chat formats:
`{"type": "text", "text": ...}` and an image as any of
- `{"type": "image", "image": X}` (Hugging Face; also the keys `url` / `path`),
- `{"type": "image_url", "image_url": {"url": X}}` or `{"type": "image_url", "image_url": X}` (OpenAI),
where X is a `PIL.Image.Image`, a local file path (`str` / `Path`, or a `file://` URL), or a base64 data URL
(`data:image/png;base64,...`). Remote `http(s)` URLs are refused: tidal never downloads.

Every image is decoded once, converted to RGB and re-encoded as PNG (lossless). vLLM gets it as a PNG data URL
(`image_url` part), and the training batch carries the same PNG bytes, so the trainer's image processor sees
the very pixels vLLM's saw. Converting to RGB here (not in each consumer) keeps alpha and palette handling from
differing between the two sides. Pure Python + Pillow: no torch (the orchestrator imports this module).
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

IMAGE_TYPES = ("image", "image_url")
"""Content part types that hold an image."""


class ImagePartError(ValueError):
    """An image part is malformed or its image cannot be read; the message says which part and why."""


def content_parts(message: dict[str, Any]) -> list[Any]:
    """The message's content as a list of parts (a string content is one text part)."""
    content = message.get("content")
    if isinstance(content, list):
        return content
    return [] if content is None else [{"type": "text", "text": content}]


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_TYPES


def has_images(prompt: list[dict[str, Any]] | str) -> bool:
    """Whether any message of a conversational prompt holds an image part."""
    return not isinstance(prompt, str) and any(is_image_part(p) for m in prompt for p in content_parts(m))


def count_images(prompt: list[dict[str, Any]] | str) -> int:
    return 0 if isinstance(prompt, str) else sum(is_image_part(p) for m in prompt for p in content_parts(m))


def _source(part: dict[str, Any]) -> Any:
    """The image a part refers to (PIL image, path, or URL string)."""
    if part["type"] == "image_url":
        ref = part.get("image_url")
        return ref.get("url") if isinstance(ref, dict) else ref
    for key in ("image", "url", "path"):
        if part.get(key) is not None:
            return part[key]
    return None


def _open(src: Any) -> Any:
    """A PIL image from a part's source; raises ImagePartError naming what was given."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(src, Image.Image):
        return src
    if isinstance(src, str) and src.startswith("data:"):
        head, _, data = src.partition(",")
        if not head.endswith(";base64"):
            raise ImagePartError(f"image data URL must be base64-encoded (data:image/...;base64,...), got {head!r}")
        try:
            raw = base64.b64decode(data, validate=True)
        except binascii.Error as exc:
            raise ImagePartError(f"image data URL is not valid base64: {exc}") from None
        stream: Any = io.BytesIO(raw)
        what = f"data URL ({len(raw)} bytes)"
    elif isinstance(src, str | Path):
        text = str(src)
        if text.startswith(("http://", "https://")):
            raise ImagePartError(f"image URL {text!r}: tidal does not download images; give a local path, a PIL "
                                 "image or a base64 data URL")
        path = Path(text.removeprefix("file://"))
        if not path.is_file():
            raise ImagePartError(f"image file {path} does not exist")
        stream, what = path, f"file {path}"
    else:
        raise ImagePartError(f"image part holds {type(src).__name__}; expected a PIL image, a file path or a "
                             "base64 data URL")
    try:
        img = Image.open(stream)
        img.load()
    except (UnidentifiedImageError, OSError) as exc:
        raise ImagePartError(f"image {what} cannot be read: {exc}") from None
    return img


def png_bytes(part: dict[str, Any]) -> bytes:
    """The part's image as RGB PNG bytes (what vLLM and the trainer both decode)."""
    src = _source(part)
    if src is None:
        raise ImagePartError(f"image part {_short(part)} names no image (expected 'image', 'url', 'path' or "
                             "'image_url': {'url': ...})")
    img = _open(src)
    buf = io.BytesIO()
    img.convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def _short(part: dict[str, Any]) -> str:
    return repr({k: (v if isinstance(v, str | int | float) and len(str(v)) < 60 else "...") for k, v in part.items()})


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def prompt_images(prompt: list[dict[str, Any]] | str) -> list[bytes]:
    """The PNG bytes of every image of the prompt, in the order they appear (the order of their placeholders)."""
    if isinstance(prompt, str):
        return []
    return [png_bytes(p) for m in prompt for p in content_parts(m) if is_image_part(p)]


def openai_messages(prompt: list[dict[str, Any]], pngs: list[bytes] | None = None) -> list[dict[str, Any]]:
    """The messages as vLLM's chat API takes them: every image part becomes `{"type": "image_url", "image_url":
    {"url": <PNG data URL>}}` (from `pngs`, the prompt's `prompt_images`, when given), other parts unchanged."""
    pngs = prompt_images(prompt) if pngs is None else pngs
    it = iter(pngs)
    out = []
    for m in prompt:
        if not isinstance(m.get("content"), list):
            out.append(m)
            continue
        parts = [{"type": "image_url", "image_url": {"url": data_url(next(it))}} if is_image_part(p) else p
                 for p in m["content"]]
        out.append({**m, "content": parts})
    return out


def text_of(content: Any) -> str:
    """A message content's text (image parts left out), e.g. for logs and samples.jsonl."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return "" if content is None else str(content)
