"""A synthetic image task for vision-language tests: "which colour is the square?".

Each example is a white image with one coloured square at a random place and size; the prompt is a user message
with the image part and the question; the reward is 1 when the completion names the square's colour, else
the share of the completion's characters that are letters of that colour's name (a shaped reward, so a random
model's completions already differ in reward and the policy gets a gradient). Images
come as PIL images, PNG data URLs or (with `image_dir`) files, in turn, so every input form reaches vLLM and
the trainer. Used through `env[].id: tests.e2e.vlm_env:SquareColour`.
"""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from tidal.envs.base import Environment, Example

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 30, 220), "yellow": (230, 210, 20)}
QUESTION = "Which colour is the square? Answer red, green, blue or yellow."


def square_image(rng: random.Random, colour: str) -> Image.Image:
    w, h = rng.choice([(32, 32), (48, 40), (40, 64)])
    img = Image.new("RGB", (w, h), (255, 255, 255))
    side = rng.randint(8, min(w, h) // 2)
    x, y = rng.randint(0, w - side), rng.randint(0, h - side)
    ImageDraw.Draw(img).rectangle([x, y, x + side - 1, y + side - 1], fill=COLOURS[colour])
    return img


class SquareColour(Environment):
    id = "square-colour"

    def __init__(self, image_dir: str | None = None) -> None:
        self.image_dir = Path(image_dir) if image_dir else None
        self.count = 0

    def _part(self, img: Image.Image, name: str) -> dict[str, Any]:
        self.count += 1
        form = self.count % (3 if self.image_dir else 2)
        if form == 0 and self.image_dir is not None:
            path = self.image_dir / f"{name}.png"
            self.image_dir.mkdir(parents=True, exist_ok=True)
            img.save(path)
            return {"type": "image", "path": str(path)}
        if form == 1:
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
            return {"type": "image_url", "image_url": {"url": url}}
        return {"type": "image", "image": img}

    def sample(self, rng: random.Random) -> Example:
        colour = rng.choice(sorted(COLOURS))
        img = square_image(rng, colour)
        part = self._part(img, f"sq{rng.getrandbits(32):08x}")
        prompt = [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]
        return Example(prompt=prompt, answer=colour)

    def reward(self, example: Example, completion: str) -> float:
        text = completion.lower()
        if example.answer in text:
            return 1.0
        return 0.5 * sum(c in example.answer for c in text) / max(len(text), 1)
