"""visual-shapes: seeded examples, answers checked against the rendered pixels (blobs counted, coloured and
classified by their geometry, not read back from the generator), the reward's answer parsing, and its `args`
checked when the config loads."""

from __future__ import annotations

import io
import random
import re

import numpy as np
import pytest
from PIL import Image

from tidal.config.environments import EnvSection
from tidal.config.orch import OrchConfig
from tidal.envs import available, make_env
from tidal.envs.images import openai_messages, prompt_images
from tidal.envs.shapes import BACKGROUND, COLOURS, parse_answer


def blobs(img: Image.Image) -> list[tuple[tuple[int, int, int], np.ndarray]]:
    """The 4-connected regions of non-background pixels: (their one colour, their (H, W) bool mask)."""
    px = np.asarray(img.convert("RGB")).astype(int)
    fg = (px != BACKGROUND).any(-1)
    seen = np.zeros_like(fg)
    out = []
    h, w = fg.shape
    for y0, x0 in zip(*np.nonzero(fg), strict=True):
        if seen[y0, x0]:
            continue
        mask, stack = np.zeros_like(fg), [(y0, x0)]
        seen[y0, x0] = True
        while stack:
            y, x = stack.pop()
            mask[y, x] = True
            for yy, xx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= yy < h and 0 <= xx < w and fg[yy, xx] and not seen[yy, xx]:
                    seen[yy, xx] = True
                    stack.append((yy, xx))
        colours = {tuple(c) for c in px[mask]}
        assert len(colours) == 1, f"a blob of {len(colours)} colours: shapes touch or are anti-aliased"
        out.append((colours.pop(), mask))
    return out


def kind_of(mask: np.ndarray) -> str:
    """A blob's kind from its geometry: the share of its bounding box it fills, and where its widest row is."""
    ys, xs = np.nonzero(mask)
    box = mask[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
    fill = box.mean()
    if fill > 0.95:
        return "square"
    if fill > 0.7:
        return "circle"
    widths = box.sum(1)
    return "triangle" if widths.argmax() >= 0.8 * (len(widths) - 1) else "diamond"


def colour_name(rgb: tuple[int, int, int]) -> str:
    (name,) = [n for n, c in COLOURS.items() if c == rgb]
    return name


def image_of(example) -> Image.Image:
    (png,) = prompt_images(example.prompt)  # what vLLM and the trainer decode
    return Image.open(io.BytesIO(png))


def test_registered_and_seeded():
    assert "visual-shapes" in available()
    env = make_env("visual-shapes", {"image_size": 64})
    a, b = [env.sample(random.Random(5)) for _ in range(2)]
    assert a.answer == b.answer and prompt_images(a.prompt) == prompt_images(b.prompt)
    r1, r2 = random.Random(3), random.Random(3)
    one = [env.sample(r1) for _ in range(20)]
    two = [env.sample(r2) for _ in range(20)]
    assert [prompt_images(e.prompt) for e in one] == [prompt_images(e.prompt) for e in two]
    assert len({prompt_images(e.prompt)[0] for e in one}) == 20, "every example draws a new image"
    assert {e.info["visual_task"] for e in one} == {"colour", "shape", "count"}


def test_prompt_is_one_image_and_a_question():
    env = make_env("visual-shapes", {"image_size": 48})
    ex = env.sample(random.Random(0))
    (msg,) = ex.prompt
    assert msg["role"] == "user" and [p["type"] for p in msg["content"]] == ["image", "text"]
    assert image_of(ex).size == (48, 48)
    sent = openai_messages(ex.prompt)[0]["content"][0]
    assert sent["type"] == "image_url" and sent["image_url"]["url"].startswith("data:image/png;base64,")


@pytest.mark.parametrize(("size", "max_shapes"), [(32, 9), (64, 4), (100, 7)])
def test_count_answers_match_the_pixels(size, max_shapes):
    env, rng = make_env("visual-shapes", {"tasks": ["count"], "image_size": size, "max_shapes": max_shapes}), \
        random.Random(size)
    counts = set()
    for _ in range(60):
        ex = env.sample(rng)
        found = blobs(image_of(ex))
        assert str(len(found)) == ex.answer, ex.answer
        assert all(colour_name(c) for c, _ in found)
        counts.add(len(found))
    assert counts == set(range(1, max_shapes + 1)), "every count from min_shapes to max_shapes occurs"


@pytest.mark.parametrize("task", ["colour", "shape"])
def test_colour_and_shape_answers_match_the_pixels(task):
    env, rng = make_env("visual-shapes", {"tasks": [task], "image_size": 128}), random.Random(1)
    answers = set()
    for _ in range(40):
        ex = env.sample(rng)
        question = ex.prompt[0]["content"][1]["text"]
        found = [(colour_name(c), kind_of(m)) for c, m in blobs(image_of(ex))]
        assert len({k for _, k in found}) == len(found) and len({c for c, _ in found}) == len(found)
        if task == "colour":
            kind = re.match(r"What colour is the (\w+)\?", question).group(1)
            assert [c for c, k in found if k == kind] == [ex.answer], (question, found)
        else:
            colour = re.match(r"Which shape is (\w+)\?", question).group(1)
            assert [k for c, k in found if c == colour] == [ex.answer], (question, found)
        answers.add(ex.answer)
    assert len(answers) >= 4


@pytest.mark.parametrize(("task", "completion", "parsed"), [
    ("colour", "red", "red"), ("colour", "Red.", "red"), ("colour", "The triangle is **blue**.", "blue"),
    ("colour", "It's red or blue", None), ("colour", "I cannot tell", None), ("colour", "reddish", None),
    ("colour", "blue... <answer>Green</answer>", "green"), ("colour", "\\boxed{yellow}", "yellow"),
    ("colour", "<answer>orange", "orange"), ("colour", "<answer></answer> red", None),
    ("shape", "circle", "circle"), ("shape", "A Circle!", "circle"), ("shape", "the red one: triangles", "triangle"),
    ("shape", "rhombus", "diamond"), ("shape", "square or circle", None), ("shape", "the red square", "square"),
    ("count", "3", "3"), ("count", "There are three shapes.", "3"), ("count", "\\boxed{07}", "7"),
    ("count", "3 or 4", None), ("count", "Twelve", "12"), ("count", "none", None), ("count", "3 shapes, 3", "3"),
])
def test_answer_parsing(task, completion, parsed):
    assert parse_answer(task, completion) == parsed


def test_reward_is_exact_match_of_the_parsed_answer():
    env, rng = make_env("visual-shapes"), random.Random(2)
    seen = set()
    for _ in range(30):
        ex = env.sample(rng)
        seen.add(ex.info["visual_task"])
        assert env.reward(ex, ex.answer) == 1.0
        assert env.reward(ex, f"The answer is <answer>{ex.answer}</answer>") == 1.0
        wrong = {"colour": "purple" if ex.answer != "purple" else "red",
                 "shape": "circle" if ex.answer != "circle" else "square",
                 "count": str(int(ex.answer) + 1) if ex.info["visual_task"] == "count" else ""}
        assert env.reward(ex, wrong[ex.info["visual_task"]]) == 0.0
        assert env.reward(ex, "") == 0.0
    assert seen == {"colour", "shape", "count"}


def test_args_checked_when_the_config_loads():
    OrchConfig.model_validate({"env": [{"id": "visual-shapes", "args": {"tasks": ["count", "count", "colour"],
                                                                        "image_size": 64, "max_shapes": 6}}]})
    with pytest.raises(ValueError, match=r"args\.image_sise: Extra inputs.*keys: tasks, image_size"):
        EnvSection(id="visual-shapes", args={"image_sise": 64})
    with pytest.raises(ValueError, match=r"args\.tasks\.0: Input should be 'colour', 'shape' or 'count'"):
        EnvSection(id="visual-shapes", args={"tasks": ["color"]})
    with pytest.raises(ValueError, match=r"min_shapes \(5\) must not exceed max_shapes \(3\)"):
        EnvSection(id="visual-shapes", args={"min_shapes": 5, "max_shapes": 3})
    with pytest.raises(ValueError, match=r"draw at most 4 shapes.*min_shapes is 5"):
        EnvSection(id="visual-shapes", args={"min_shapes": 5, "max_shapes": 9})
    EnvSection(id="visual-shapes", args={"tasks": ["count"], "min_shapes": 5, "max_shapes": 9})
    with pytest.raises(ValueError, match=r"args\.tasks: List should have at least 1 item"):
        make_env("visual-shapes", {"tasks": []})
    with pytest.raises(ValueError, match=r"args\.image_size: Input should be greater than or equal to 32"):
        make_env("visual-shapes", {"image_size": 16})


def test_task_mix_follows_the_list():
    env, rng = make_env("visual-shapes", {"tasks": ["count", "count", "shape"], "image_size": 32}), random.Random(0)
    tasks = [env.sample(rng).info["visual_task"] for _ in range(600)]
    assert set(tasks) == {"count", "shape"} and 340 <= tasks.count("count") <= 460  # 400 expected, sd ~11.5


def test_examples_travel_to_an_env_server_as_the_same_png():
    """`env[].spawn` / `address`: the example crosses the wire as JSON, its image as a PNG data URL."""
    import json

    from tidal.envs.remote import example_from_json, example_to_json

    ex = make_env("visual-shapes", {"image_size": 40}).sample(random.Random(4))
    back = example_from_json(json.loads(json.dumps(example_to_json(ex))))
    assert prompt_images(back.prompt) == prompt_images(ex.prompt) and back.answer == ex.answer
    assert make_env("visual-shapes").reward(back, ex.answer) == 1.0
