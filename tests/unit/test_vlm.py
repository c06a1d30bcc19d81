"""Vision-language pieces without vLLM: image parts -> PNG / data URLs, the batch's image arrays on the wire,
packing with images, and the trainer's logprobs of a random tiny Idefics3 against the model's own forward."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.e2e.vlm_env import SquareColour
from tests.tiny_vlm import IMAGE_TOKEN_ID, TOKENS_PER_IMAGE, build_tiny_vlm
from tidal.config.load import ConfigError
from tidal.config.orch import OrchConfig
from tidal.config.train import TrainConfig
from tidal.envs.base import Example
from tidal.envs.images import (
    ImagePartError,
    count_images,
    data_url,
    has_images,
    openai_messages,
    png_bytes,
    prompt_images,
    text_of,
)
from tidal.inference.protocol import Completion
from tidal.orchestrator.assemble import build_batch
from tidal.trainer.model.load import load_base_model, load_policy
from tidal.trainer.model.vision import NotAVisionModel, attach_images, embed, image_processor
from tidal.trainer.step.logprobs import forward_logprobs, token_logprobs
from tidal.trainer.step.packing import pack
from tidal.transport.batch import TrainingBatch


def square(colour: tuple[int, int, int], size: tuple[int, int] = (40, 32)) -> Image.Image:
    img = Image.new("RGB", size, (255, 255, 255))
    img.paste(colour, (4, 4, 20, 20))
    return img


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"))


# --- image parts -----------------------------------------------------------------------------------------------

def test_every_image_form_gives_the_same_rgb_png(tmp_path):
    img = square((200, 10, 10))
    path = tmp_path / "sq.png"
    img.save(path)
    raw = io.BytesIO()
    img.save(raw, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(raw.getvalue()).decode()
    parts = [{"type": "image", "image": img}, {"type": "image", "path": str(path)}, {"type": "image", "url": url},
             {"type": "image", "image": f"file://{path}"}, {"type": "image_url", "image_url": {"url": url}},
             {"type": "image_url", "image_url": str(path)}, {"type": "image", "image": img.convert("RGBA")}]
    pngs = {png_bytes(p) for p in parts}
    assert len(pngs) == 1
    decoded = Image.open(io.BytesIO(pngs.pop()))
    assert decoded.mode == "RGB" and decoded.size == (40, 32)
    assert np.array_equal(np.asarray(decoded), np.asarray(img))


@pytest.mark.parametrize(("part", "words"), [
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "does not download"),
    ({"type": "image", "path": "/no/such/image.png"}, "does not exist"),
    ({"type": "image", "image": "data:image/png;base64,@@@"}, "not valid base64"),
    ({"type": "image", "image": "data:image/png," + "x"}, "base64-encoded"),
    ({"type": "image", "image": "data:image/png;base64," + base64.b64encode(b"not an image").decode()},
     "cannot be read"),
    ({"type": "image", "image": 42}, "expected a PIL image"),
    ({"type": "image"}, "names no image"),
])
def test_bad_image_parts_are_named(part, words):
    with pytest.raises(ImagePartError, match=words):
        png_bytes(part)


def test_messages_for_vllm_keep_order_and_text():
    red, blue = square((200, 10, 10)), square((10, 10, 200))
    prompt = [{"role": "system", "content": "Look closely."},
              {"role": "user", "content": [{"type": "text", "text": "A "}, {"type": "image", "image": red},
                                           {"type": "text", "text": " B "}, {"type": "image", "image": blue}]}]
    assert has_images(prompt) and count_images(prompt) == 2 and not has_images("plain") and count_images("x") == 0
    pngs = prompt_images(prompt)
    out = openai_messages(prompt, pngs)
    assert out[0] == prompt[0]
    parts = out[1]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url", "text", "image_url"]
    assert parts[1]["image_url"]["url"] == data_url(pngs[0]) and parts[3]["image_url"]["url"] == data_url(pngs[1])
    assert text_of(prompt[1]["content"]) == "A  B " and text_of("t") == "t"
    assert prompt[1]["content"][1]["image"] is red, "the example's own prompt is not changed"


# --- the batch on the wire and packing -------------------------------------------------------------------------

def comp(n: int, first: int = 40) -> Completion:
    return Completion(list(range(first, first + n)), [-0.5] * n, "x" * n, "stop")


def image_batch(step: int = 1) -> tuple[TrainingBatch, list[list[bytes]]]:
    """Three prompts: one image, no image, two images (one of them the first prompt's), two completions each."""
    a, b = png_bytes({"type": "image", "image": square((200, 0, 0))}), png_bytes(
        {"type": "image", "image": square((0, 0, 200))})
    prompts = [[1, 5, 6], [1, 7], [1, 8, 9, 10]]
    groups = [[comp(3), comp(2)], [comp(4), comp(1)], [comp(2), comp(5)]]
    images = [[a], [], [b, a]]
    adv = [np.full(len(c.token_ids), 0.5) for g in groups for c in g]
    batch, _ = build_batch(step, prompts, groups, np.zeros(6), adv, 0, OrchConfig(rollouts_per_example=2),
                           images=images)
    return batch, images


def test_batch_images_round_trip_in_safetensors(tmp_path):
    batch, images = image_batch()
    assert batch.has_images and len(batch.image_lengths) == 2, "each distinct image once"
    assert [batch.images_of(i) for i in range(6)] == [[0], [0], [], [], [1, 0], [1, 0]]
    assert batch.prompt_lengths.tolist() == [3, 3, 2, 2, 4, 4]
    for back in (TrainingBatch.from_bytes(batch.to_bytes()), (batch.save(tmp_path / "b.safetensors"),
                                                              TrainingBatch.load(tmp_path / "b.safetensors"))[1]):
        assert back.image_bytes(0) == images[0][0] and back.image_bytes(1) == images[2][0]
        assert [back.images_of(i) for i in range(6)] == [batch.images_of(i) for i in range(6)]
        assert np.array_equal(back.prompt_lengths, batch.prompt_lengths)
    assert b"pickle" not in batch.to_bytes()[:200]
    text, _ = build_batch(1, [[1, 2]], [[comp(2)]], np.zeros(1), [np.zeros(2)], 0, OrchConfig(rollouts_per_example=1),
                          images=[[]])
    assert not text.has_images and TrainingBatch.from_bytes(text.to_bytes()).image_data is None


def test_inconsistent_image_arrays_are_refused():
    batch, _ = image_batch()
    fields = {k: getattr(batch, k) for k in ("step", "temperature", "tokens", "lengths", "loss_mask",
                                             "inference_logprobs", "advantages", "rewards", "policy_steps")}
    with pytest.raises(ValueError, match="given without"):
        TrainingBatch(**fields, image_data=batch.image_data)
    with pytest.raises(ValueError, match="must index"):
        TrainingBatch(**fields, image_data=batch.image_data, image_lengths=batch.image_lengths,
                      sample_images=batch.sample_images + 5, sample_image_counts=batch.sample_image_counts,
                      prompt_lengths=batch.prompt_lengths)


def test_stale_batch_drops_its_images():
    batch, _ = image_batch(step=20)  # sampled by policy 0, max_off_policy_steps 8 by default: too old
    assert batch.num_samples == 0 and not batch.has_images


def test_packing_lists_images_in_placeholder_order():
    batch, _ = image_batch()
    micro = pack(batch, sequence_len=20, rows_per_micro_batch=1)
    seen: list[int] = []
    for mb in micro:
        assert mb.prompt_mask is not None and mb.image_ids is not None
        want: list[int] = []
        for r in range(mb.input_ids.shape[0]):
            row = mb.seq_ids[r]
            for i in dict.fromkeys(int(x) for x in row[row >= 0]):  # samples in row order
                cols = (row == i).nonzero().flatten()
                assert mb.prompt_mask[r, cols].tolist() == [k < batch.prompt_lengths[i] for k in range(len(cols))]
                want += batch.images_of(i)
                seen.append(i)
        assert mb.image_ids.tolist() == want
    assert sorted(seen) == list(range(6))


# --- the trainer ------------------------------------------------------------------------------------------------

def vlm_sample(proc, images: list[Image.Image], completion: list[int]) -> tuple[list[int], dict]:
    """Prompt ids as the processor expands them (as vLLM does), plus the completion; the processor's pixels."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "colour?"}]
    text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                    tokenize=False)
    out = proc(text=[text], images=[images], return_tensors="pt")
    return out["input_ids"][0].tolist() + completion, {k: out[k] for k in ("pixel_values", "pixel_attention_mask")}


def two_sample_batch(vlm_dir: Path, first: Image.Image, second: list[Image.Image],
                     completion_extra: list[int] | None = None) -> tuple[TrainingBatch, list, list]:
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(vlm_dir)
    ids1, px1 = vlm_sample(proc, [first], [40, 41, 42] + (completion_extra or []))
    ids2, px2 = vlm_sample(proc, second, [50, 51])
    pngs = [png_bytes({"type": "image", "image": im}) for im in [first, *second]]
    n1, n2 = len(ids1) - 3 - len(completion_extra or []), len(ids2) - 2
    prompts, groups = [ids1[:n1], ids2[:n2]], [[comp(len(ids1) - n1)], [comp(2)]]
    groups[0][0].token_ids, groups[1][0].token_ids = ids1[n1:], ids2[n2:]
    adv = [np.ones(len(ids1) - n1), np.ones(2)]
    batch, _ = build_batch(1, prompts, groups, np.zeros(2), adv, 0, OrchConfig(rollouts_per_example=1),
                           images=[[pngs[0]], pngs[1:]])
    return batch, [ids1, ids2], [px1, px2]


@pytest.mark.parametrize("chunk", [0, 4])
def test_packed_logprobs_with_images_equal_the_models_own_forward(vlm_dir, chunk):
    """Two samples (one and two images) packed in one row: the trainer's logprobs of the completion tokens equal
    the Hugging Face model's own forward on each sample alone, with the processor's pixels."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    red, blue = square((220, 30, 30)), square((30, 30, 220), (32, 48))
    batch, seqs, pixels = two_sample_batch(vlm_dir, red, [blue, red])
    assert [s.count(IMAGE_TOKEN_ID) for s in seqs] == [TOKENS_PER_IMAGE, 2 * TOKENS_PER_IMAGE]
    (mb,) = pack(batch, sequence_len=256, rows_per_micro_batch=1)
    assert mb.input_ids.shape[0] == 1, "both samples in one row"
    attach_images(model, batch, [mb], str(vlm_dir), "tiny-vlm")
    with torch.no_grad():
        got = forward_logprobs(model, mb.input_ids, mb.position_ids, 0.7, chunk_size=chunk, loss_mask=mb.loss_mask,
                               images=mb.images)
        for i, (ids, px) in enumerate(zip(seqs, pixels, strict=True)):
            t = torch.tensor([ids])
            want = token_logprobs(model(input_ids=t, **px, use_cache=False).logits, t, 0.7)[0]
            cols = (mb.seq_ids[0] == i) & mb.loss_mask[0]
            n = int(cols.sum())
            torch.testing.assert_close(got[0, cols], want[-n:], rtol=1e-5, atol=1e-5)
    # the images matter: other pixels, other logprobs
    batch2, _, _ = two_sample_batch(vlm_dir, square((30, 200, 30)), [square((0, 0, 0), (32, 48)), red])
    (mb2,) = pack(batch2, sequence_len=256, rows_per_micro_batch=1)
    attach_images(model, batch2, [mb2], str(vlm_dir), "tiny-vlm")
    with torch.no_grad():
        changed = forward_logprobs(model, mb2.input_ids, mb2.position_ids, 0.7, chunk_size=chunk,
                                   loss_mask=mb2.loss_mask, images=mb2.images)
    assert (changed - got).abs().max() > 1e-3


def test_a_sampled_image_token_is_embedded_as_a_token(vlm_dir):
    """A completion that samples the image token: vLLM embeds it as a plain token, and so does the trainer (the
    image features go on the prompt's placeholders only)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    batch, seqs, _ = two_sample_batch(vlm_dir, square((220, 30, 30)), [square((30, 30, 220))], [IMAGE_TOKEN_ID])
    (mb,) = pack(batch, sequence_len=256, rows_per_micro_batch=1)
    attach_images(model, batch, [mb], str(vlm_dir), "tiny-vlm")
    assert int(mb.images.mask.sum()) == 2 * TOKENS_PER_IMAGE
    assert int((mb.input_ids == IMAGE_TOKEN_ID).sum()) == 2 * TOKENS_PER_IMAGE + 1
    with torch.no_grad():
        emb = embed(model, mb.input_ids, mb.images)
        sampled = (mb.input_ids[0] == IMAGE_TOKEN_ID) & ~mb.prompt_mask[0]
        assert torch.equal(emb[0, sampled][0], model.get_input_embeddings().weight[IMAGE_TOKEN_ID])
        lp = forward_logprobs(model, mb.input_ids, mb.position_ids, 1.0, loss_mask=mb.loss_mask, images=mb.images)
    assert torch.isfinite(lp).all()


def test_image_processor_is_the_models(vlm_dir):
    proc = image_processor(str(vlm_dir))
    assert type(proc).__name__.startswith("Idefics3ImageProcessor")


def test_lora_goes_on_the_language_model_only(vlm_dir):
    cfg = TrainConfig(model=str(vlm_dir), device="cpu")
    model, _ = load_policy(cfg)
    lora = [n for n, p in model.named_parameters() if p.requires_grad]
    assert lora and all("lora_" in n and ".text_model." in n for n in lora), lora[:5]
    assert any("q_proj" in n for n in lora) and any("down_proj" in n for n in lora)


def test_a_text_only_model_refuses_a_batch_with_images():
    model = load_base_model("tidal:tiny-reverse", torch.device("cpu"), torch.float32)
    batch, _ = image_batch()
    micro = pack(batch, 64, 2)
    with pytest.raises(NotAVisionModel, match=r"'tidal:tiny-reverse' \(Qwen3ForCausalLM\) is a text-only model"):
        attach_images(model, batch, micro, "unused", "tidal:tiny-reverse")


def test_an_unsupported_vlm_family_is_refused_by_name(tmp_path):
    from transformers import LlavaConfig

    LlavaConfig(architectures=["LlavaForConditionalGeneration"]).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="LlavaForConditionalGeneration.*Idefics3ForConditionalGeneration, "
                                          "Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration"):
        load_base_model(str(tmp_path), torch.device("cpu"), torch.float32)


# --- environments -----------------------------------------------------------------------------------------------

def test_square_colour_env_uses_every_image_form(tmp_path):
    env = SquareColour(image_dir=str(tmp_path))
    rng = random.Random(0)
    examples = [env.sample(rng) for _ in range(6)]
    kinds = {json.dumps(sorted(k for k in ex.prompt[0]["content"][0] if k != "type")) for ex in examples}
    assert kinds == {'["image"]', '["image_url"]', '["path"]'}
    assert all(len(prompt_images(ex.prompt)) == 1 for ex in examples)
    assert env.reward(examples[0], f"it is {examples[0].answer}") == 1.0


def test_the_verifiers_adapter_passes_images_through():
    """A verifiers dataset whose prompts hold image parts: the adapter keeps them (with the text, in order)."""
    vf = pytest.importorskip("verifiers", reason="the verifiers package is part of the dev install")
    from datasets import Dataset

    from tidal.envs.verifiers import VerifiersEnv

    png = png_bytes({"type": "image", "image": square((200, 10, 10))})
    rows = [{"prompt": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png)}},
        {"type": "text", "text": "Which colour is the square?"}]}], "answer": "red"}]
    env = VerifiersEnv(vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[], weights=[])),
                       "img")
    ex = env.sample(random.Random(0))
    content = ex.prompt[-1]["content"]
    assert [p["type"] for p in content] == ["image_url", "text"] and content[1]["text"].startswith("Which")
    assert prompt_images(ex.prompt) == [png], "the very image reaches tidal's prompt"


# --- what is refused --------------------------------------------------------------------------------------------

def image_example() -> Example:
    return Example(prompt=[{"role": "user", "content": [{"type": "image", "image": square((1, 2, 3))},
                                                        {"type": "text", "text": "colour?"}]}], task="sq")


def test_multi_turn_rollouts_of_image_prompts_are_refused():
    from tidal.config.orch import SamplingSection
    from tidal.orchestrator.rollout import multi_turn_group

    class TwoTurns(SquareColour):
        max_turns = 2

    with pytest.raises(ValueError, match="multi-turn .* holds images"):
        asyncio.run(multi_turn_group(None, "m", [1, 2], 2, SamplingSection(), 64, None, 1.0,  # type: ignore[arg-type]
                                     TwoTurns(), image_example()))


def test_teacher_logprobs_of_image_prompts_are_refused():
    from tidal.config.orch import TeacherSection
    from tidal.orchestrator.groups import Collected, teacher_logprobs

    got = Collected()
    got.add(image_example(), [1, 2], [comp(2)], np.zeros((1, 1)), [b"png"])
    with pytest.raises(ValueError, match="teacher logprobs of prompts with images"):
        asyncio.run(teacher_logprobs(None, TeacherSection(model="t"), got))  # type: ignore[arg-type]


def test_sft_of_image_prompts_is_refused():
    from tidal.trainer.model.load import load_tokenizer
    from tidal.trainer.sft import make_sft_batch

    with pytest.raises(ValueError, match="environment 'sq' has images"):
        make_sft_batch(load_tokenizer("tidal:tiny-reverse"), [image_example()], ["red"], 1)


def test_remote_environments_send_images_as_data_urls():
    from tidal.envs.remote import example_from_json, example_to_json

    ex = image_example()
    back = example_from_json(json.loads(json.dumps(example_to_json(ex))))
    assert back.prompt[0]["content"][0]["type"] == "image_url" and back.task == "sq"
    assert prompt_images(back.prompt) == prompt_images(ex.prompt)
