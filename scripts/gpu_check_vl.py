"""`make gpu-check` row q's parts (scripts/gpu_check.py `check_qwen_vl`): a tiny random Qwen2.5-VL that vLLM can
serve, and the comparison of vLLM's image placeholders with the trainer's.

The model (`build_servable_qwen2_5_vl`): 2 decoder layers (hidden 128, head_dim 64, `mrope_section` [8, 12, 12]),
a 2-block vision tower (hidden 128, head_dim 64, 8 x 8 patches, 2 x 2 merge: one image token per 16 x 16 pixels,
its first block windowed), random init, bfloat16 (the GPU rows' dtype). Head sizes of 64 keep vLLM's CUDA
attention backends (text and vision) on sizes they support. The bundled model's character-level tokenizer comes
along with four unused special tokens renamed to Qwen's (`<|vision_start|>` 102, `<|vision_end|>` 103,
`<|image_pad|>` 104, `<|video_pad|>` 105, the ids the config names) and a chat template that renders an image part
as Qwen's does (`<|vision_start|><|image_pad|><|vision_end|>`). vLLM's Qwen2.5-VL processor (0.24 and 0.32:
`Qwen2VLMultiModalProcessor._get_prompt_updates`) replaces each `<|image_pad|>` by grid_thw.prod() // merge_size**2
copies, grid_thw from the Hugging Face processor of this directory; the image processor here (min_pixels 256,
max_pixels 65536) leaves visual-shapes' 64-pixel images at their size (a (1, 8, 8) grid: 16 tokens), so no resize
could differ between vLLM's processor and the trainer's.

The comparison (`placeholder_counts`): per sample of a saved batch, the `<|image_pad|>` tokens in the prompt vLLM's
`/tokenize` returned, and the tokens the trainer's image processor (`tidal.trainer.model.vision.image_processor`)
gives its images (grid product // merge**2). tests/unit/test_gpu_check_vl.py checks on CPU what it can: the
directory loads as the Hugging Face processor, its chat template and placeholder expansion equal those counts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 102, 103, 104, 105
TOKENS = {VISION_START: "<|vision_start|>", VISION_END: "<|vision_end|>", IMAGE_PAD: "<|image_pad|>",
          VIDEO_PAD: "<|video_pad|>"}
IMAGE_SIZE = 64
"""visual-shapes' `image_size` in the row: 64 x 64 pixels, a (1, 8, 8) grid, 16 image tokens."""
TOKENS_PER_IMAGE = 16
MERGE = 2
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] in ['image', 'image_url'] %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-6,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]})
VISION = dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2, patch_size=8, spatial_merge_size=MERGE,
              temporal_patch_size=2, out_hidden_size=128, window_size=32, fullatt_block_indexes=[1])
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
                "patch_size": 8, "merge_size": MERGE, "temporal_patch_size": 2, "min_pixels": 256,
                "max_pixels": 65536, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_resize": True,
                "do_rescale": True, "do_normalize": True, "do_convert_rgb": True}
GRPO_ARGS = ["--orch.max_async_level", "0", "--orch.max_steps", "2", "--orch.batch_size", "16",
             "--orch.rollouts_per_example", "4", "--orch.sampling.max_tokens", "16", "--infer.enforce_eager", "true",
             "--orch.env", json.dumps([{"id": "visual-shapes", "args": {"image_size": IMAGE_SIZE}}])]
"""The row's `tidal grpo` flags besides the model: 2 on-policy steps of 4 prompts x 4 completions."""


def config() -> Any:
    """The tiny Qwen2.5-VL's `Qwen2_5_VLConfig` (module doc)."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE_PAD,
                            video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
                            vision_end_token_id=VISION_END, tie_word_embeddings=False)


def write_processor_files(out: Path) -> Path:
    """The tokenizer (Qwen's vision tokens renamed in), chat template and image processor config into `out`."""
    from tidal.models.sources import resolve_model

    out.mkdir(parents=True, exist_ok=True)
    src = Path(resolve_model("tidal:tiny-reverse"))
    tok = json.loads((src / "tokenizer.json").read_text())
    for t in tok["added_tokens"]:
        t["content"] = TOKENS.get(t["id"], t["content"])
    tok["model"]["vocab"] = {TOKENS.get(i, k): i for k, i in tok["model"]["vocab"].items()}
    (out / "tokenizer.json").write_text(json.dumps(tok))
    shutil.copy(src / "tokenizer_config.json", out / "tokenizer_config.json")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return out


def build_servable_qwen2_5_vl(out: Path, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Write the tiny Qwen2.5-VL (module doc) into `out`; returns it (kept when already built)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    Qwen2_5_VLForConditionalGeneration(config()).to(getattr(torch, dtype)).save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)
    return write_processor_files(out)


def placeholder_counts(batch: Any, model_dir: Path) -> list[tuple[int, int]]:
    """Per sample of `batch` (a `TrainingBatch`): (the `<|image_pad|>` tokens of its prompt, as vLLM expanded
    them; the image tokens the trainer's image processor gives the sample's images)."""
    import numpy as np

    from tidal.trainer.model.vision import image_processor, pixel_tensors

    proc = image_processor(str(model_dir))
    out = []
    for i, s in enumerate(batch.samples()):
        prompt = batch.tokens[s][:int(batch.prompt_lengths[i])]
        grids = [pixel_tensors(proc, batch.image_bytes(j))["image_grid_thw"] for j in batch.images_of(i)]
        out.append((int(np.count_nonzero(prompt == IMAGE_PAD)), sum(int(g.prod()) // MERGE ** 2 for g in grids)))
    return out


def placeholder_problem(run_dir: Path, model_dir: Path, figures: dict[str, Any]) -> str | None:
    """What is wrong with the run's image placeholders (None: every sample of both steps' batches has vLLM's count
    = the trainer's = `TOKENS_PER_IMAGE` per image); puts the counts in `figures`."""
    from tidal.paths import batch_path
    from tidal.transport.batch import TrainingBatch

    seen = []
    for step in (1, 2):
        path = batch_path(run_dir, step)
        if not path.exists():
            return f"{path} is missing (the row reads the filesystem transport's batches)"
        batch = TrainingBatch.load(path)
        if not batch.has_images:
            return f"step {step}'s batch holds no images"
        counts = placeholder_counts(batch, model_dir)
        seen += counts
        bad = [(i, c) for i, c in enumerate(counts) if c[0] != c[1] or c[0] != TOKENS_PER_IMAGE]
        if bad:
            return (f"step {step}: samples whose (vLLM placeholders, trainer image tokens) differ or are not "
                    f"{TOKENS_PER_IMAGE}: {bad[:4]}")
    figures["image tokens per prompt (vLLM = trainer)"] = sorted({c[0] for c in seen})
    figures["samples checked"] = len(seen)
    return None
