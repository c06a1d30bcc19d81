"""`make gpu-check` row q's tiny Qwen2.5-VL, on CPU where vLLM cannot serve it (no torchvision): its tokenizer
and config name the same vision token ids, its chat template renders what tidal sends vLLM (visual-shapes'
messages, images as PNG data URLs) with Qwen's placeholder, and the Hugging Face processor of its directory (what
vLLM's Qwen2.5-VL processor runs, replacing each `<|image_pad|>` by grid_thw.prod() // merge_size**2 copies)
expands each image to as many tokens as the trainer's image processor gives it — the count the row then compares
on the GPU between vLLM's `/tokenize` and the trainer (`placeholder_counts`, checked here on a batch built from
the processor's expansion)."""

from __future__ import annotations

import io
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tidal.config.orch import OrchConfig
from tidal.envs import make_env
from tidal.envs.images import openai_messages, png_bytes
from tidal.inference.protocol import Completion
from tidal.orchestrator.assemble import build_batch
from tidal.trainer.model.vision import image_processor, pixel_tensors

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import gpu_check_vl as q  # noqa: E402


@pytest.fixture(scope="module")
def proc_dir(tmp_path_factory) -> Path:
    return q.write_processor_files(tmp_path_factory.mktemp("qwen-vl-row"))


@pytest.fixture(scope="module")
def hf_processor(proc_dir):
    """The Hugging Face Qwen2.5-VL processor of the directory, without its video processor (torchvision)."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor

    class ImagesOnly(Qwen2_5_VLProcessor):  # its class check of the video processor needs torchvision
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name != "video_processor":
                return super().check_argument_for_proper_class(argument_name, argument)
            return None

    return ImagesOnly(image_processor=image_processor(str(proc_dir)), tokenizer=AutoTokenizer.from_pretrained(proc_dir),
                      video_processor=None, chat_template=q.CHAT_TEMPLATE)


def test_tokenizer_and_config_name_the_same_vision_tokens(hf_processor):
    tok, cfg = hf_processor.tokenizer, q.config()
    assert {i: tok.convert_tokens_to_ids(t) for i, t in q.TOKENS.items()} == {i: i for i in q.TOKENS}
    assert (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id) == \
        (q.IMAGE_PAD, q.VIDEO_PAD, q.VISION_START, q.VISION_END)
    assert hf_processor.image_token_id == q.IMAGE_PAD and len(tok) <= cfg.text_config.vocab_size
    assert tok.encode("<|vision_start|><|image_pad|><|vision_end|>", add_special_tokens=False) == \
        [q.VISION_START, q.IMAGE_PAD, q.VISION_END]
    assert sum(cfg.text_config.rope_parameters["mrope_section"]) == cfg.text_config.head_dim // 2


def expand(hf_processor, messages, img: Image.Image) -> list[int]:
    text = hf_processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 1, text
    return hf_processor(text=[text], images=[img], return_tensors="np")["input_ids"][0].tolist()


@pytest.mark.parametrize("size", [(64, 64), (40, 32), (100, 60), (224, 224), (400, 300)])
def test_processor_expansion_equals_the_trainers_image_tokens(hf_processor, proc_dir, size):
    rng = np.random.default_rng(size[0])
    img = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    png = png_bytes({"type": "image", "image": img})
    messages = openai_messages([{"role": "user", "content": [{"type": "image", "image": img},
                                                             {"type": "text", "text": "How many?"}]}])
    ids = expand(hf_processor, messages, Image.open(io.BytesIO(png)))
    grid = pixel_tensors(image_processor(str(proc_dir)), png)["image_grid_thw"]
    assert ids.count(q.IMAGE_PAD) == int(grid.prod()) // q.MERGE ** 2
    if size == (q.IMAGE_SIZE, q.IMAGE_SIZE):  # the row's images keep their size: 8 x 8 patches, 16 tokens
        assert grid.tolist() == [[1, 8, 8]] and ids.count(q.IMAGE_PAD) == q.TOKENS_PER_IMAGE
    assert int(grid.prod()) * 8 * 8 <= q.PREPROCESSOR["max_pixels"]


def test_placeholder_counts_of_a_visual_shapes_batch(hf_processor, proc_dir):
    env, rng = make_env("visual-shapes", {"image_size": q.IMAGE_SIZE}), random.Random(0)
    prompts, groups, images = [], [], []
    for _ in range(3):
        ex = env.sample(rng)
        png = png_bytes(ex.prompt[0]["content"][0])
        prompts.append(expand(hf_processor, openai_messages(ex.prompt), Image.open(io.BytesIO(png))))
        groups.append([Completion([5, 6, 2], [-1.0] * 3, "x", "stop")] * 2)
        images.append([png])
    batch, _ = build_batch(1, prompts, groups, np.zeros(6), [np.ones(3)] * 6, 0,
                           OrchConfig(rollouts_per_example=2), images=images)
    assert q.placeholder_counts(batch, proc_dir) == [(q.TOKENS_PER_IMAGE, q.TOKENS_PER_IMAGE)] * 6
    batch.tokens[np.flatnonzero(batch.tokens == q.IMAGE_PAD)[0]] = 7  # one placeholder fewer in sample 0
    assert q.placeholder_counts(batch, proc_dir)[:2] == [(15, 16), (16, 16)]
