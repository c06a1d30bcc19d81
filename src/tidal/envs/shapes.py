"""visual-shapes: questions about a generated image of coloured shapes, for vision-language models.

Each example is one white square image (`image_size` pixels) with 1..n shapes — squares, circles, triangles and
diamonds, in six well-separated colours — and one question about it (`tidal.config.environments.VisualShapesArgs`):
- `colour`: "What colour is the triangle?" (every kind at most once, every shape its own colour);
- `shape`: "Which shape is red?" (the same kind of image);
- `count`: "How many shapes are in the image?" (any kinds and colours, repeats allowed).
Shapes sit one per cell of a g x g grid (g = ceil(sqrt(max_shapes))), inside the cell with a margin, so they never
touch and a count is a count of separate blobs. Drawn by Pillow without anti-aliasing: every pixel is the
background or exactly one shape's colour (tests/unit/test_shapes_env.py recounts and recolours the pixels).
The run's RNG draws everything (the image, the question), so the same seed gives the same examples.

The image is a PIL image part (`{"type": "image", "image": img}`), which the orchestrator turns into the PNG that
both vLLM and the trainer decode (`tidal.envs.images`). The reward is exact match after parsing (`parse_answer`):
the answer inside `<answer>...</answer>` or `\\boxed{...}` when present, else the whole completion; in it, the
words of the task's vocabulary (colour names; shape names, plural or `rhombus`; numbers as digits or words up to
twelve); 1 when exactly one distinct such value appears and it is right, else 0 (naming two candidates scores 0).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Any

from tidal.config.environments import KINDS_PER_IMAGE, VisualShapesArgs, check_args
from tidal.envs.base import Environment, Example

KINDS = ("square", "circle", "triangle", "diamond")
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "yellow": (240, 200, 20),
           "purple": (140, 50, 170), "orange": (245, 130, 20)}
"""Colour names -> RGB fills (far apart, none near white)."""
BACKGROUND = (255, 255, 255)
NUMBERS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve".split())}
KIND_WORDS = {**{k: k for k in KINDS}, **{k + "s": k for k in KINDS}, "rhombus": "diamond", "rhombi": "diamond",
              "rhombuses": "diamond"}
assert len(KINDS) == KINDS_PER_IMAGE
_TAGGED = re.compile(r"<answer>(.*?)(?:</answer>|$)|\\boxed\{([^{}]*)\}", re.S | re.I)


@dataclass(frozen=True)
class Shape:
    """One drawn shape: its kind, colour name and bounding box (x0, y0, x1, y1; inclusive pixels)."""

    kind: str
    colour: str
    box: tuple[int, int, int, int]


def layout(rng: random.Random, n: int, size: int, grid: int, kinds: list[str], colours: list[str]) -> list[Shape]:
    """`n` shapes in `n` distinct random cells of a `grid` x `grid` grid over a `size`-pixel image: each a square
    bounding box of 45..80% of the cell (at least 3 pixels), at a random place inside the cell, 1 pixel clear of
    its edges."""
    cell = size // grid
    out = []
    cells = rng.sample(range(grid * grid), n)
    for i, (kind, colour) in enumerate(zip(kinds, colours, strict=True)):
        row, col = divmod(cells[i], grid)
        side = max(3, min(cell - 2, rng.randint(int(cell * 0.45), int(cell * 0.8))))
        x0 = col * cell + 1 + rng.randint(0, cell - 2 - side)
        y0 = row * cell + 1 + rng.randint(0, cell - 2 - side)
        out.append(Shape(kind, colour, (x0, y0, x0 + side - 1, y0 + side - 1)))
    return out


def render(shapes: list[Shape], size: int) -> Any:
    """The shapes on a white `size` x `size` RGB image (no anti-aliasing: exact fill colours)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for s in shapes:
        x0, y0, x1, y1 = s.box
        fill = COLOURS[s.colour]
        cx, cy = (x0 + x1) // 2, (y0 + y1) // 2
        if s.kind == "square":
            draw.rectangle(s.box, fill=fill)
        elif s.kind == "circle":
            draw.ellipse(s.box, fill=fill)
        elif s.kind == "triangle":  # apex up, base along the bottom edge
            draw.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=fill)
        else:  # diamond: the box's edge midpoints
            draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=fill)
    return img


def _candidates(task: str, words: list[str]) -> set[str]:
    if task == "colour":
        return {w for w in words if w in COLOURS}
    if task == "shape":
        return {KIND_WORDS[w] for w in words if w in KIND_WORDS}
    return {str(int(w)) if w.isdigit() else str(NUMBERS[w]) for w in words if w.isdigit() or w in NUMBERS}


def parse_answer(task: str, completion: str) -> str | None:
    """The one value of `task`'s vocabulary (a colour name, a shape kind, a count as digits) that the answer
    names: inside the last `<answer>` tag or `\\boxed{}` when there is one, else anywhere in the completion; None
    when it names none or several."""
    tagged = [m.group(1) if m.group(1) is not None else m.group(2) for m in _TAGGED.finditer(completion)]
    text = (tagged[-1] if tagged else completion).lower()
    found = _candidates(task, re.findall(r"[a-z]+|\d+", text))
    return found.pop() if len(found) == 1 else None


class VisualShapes(Environment):
    """Questions about generated images of coloured shapes (module doc); `args` are `VisualShapesArgs`."""

    id = "visual-shapes"

    def __init__(self, **args: Any) -> None:
        self.args: VisualShapesArgs = check_args(VisualShapesArgs, f"environment '{self.id}'", args)
        self.grid = math.isqrt(self.args.max_shapes - 1) + 1

    def scene(self, rng: random.Random, task: str) -> list[Shape]:
        """The shapes of one example of `task`."""
        a = self.args
        if task == "count":
            n = rng.randint(a.min_shapes, a.max_shapes)
            kinds, colours = [rng.choice(KINDS) for _ in range(n)], [rng.choice(sorted(COLOURS)) for _ in range(n)]
        else:
            n = rng.randint(a.min_shapes, min(a.max_shapes, KINDS_PER_IMAGE))
            kinds, colours = rng.sample(KINDS, n), rng.sample(sorted(COLOURS), n)
        return layout(rng, n, a.image_size, self.grid, kinds, colours)

    def sample(self, rng: random.Random) -> Example:
        task = rng.choice(self.args.tasks)
        shapes = self.scene(rng, task)
        if task == "count":
            question, answer = "How many shapes are in the image? Answer with a number.", str(len(shapes))
        else:
            target = rng.choice(shapes)
            if task == "colour":
                question = (f"What colour is the {target.kind}? Answer with one word: "
                            f"{', '.join(sorted(COLOURS))}.")
                answer = target.colour
            else:
                question = f"Which shape is {target.colour}? Answer with one word: {', '.join(KINDS)}."
                answer = target.kind
        content = [{"type": "image", "image": render(shapes, self.args.image_size)},
                   {"type": "text", "text": question}]
        return Example(prompt=[{"role": "user", "content": content}], answer=answer,
                       info={"visual_task": task, "num_shapes": len(shapes)})

    def reward(self, example: Example, completion: str) -> float:
        return float(parse_answer(example.info["visual_task"], completion) == example.answer)
