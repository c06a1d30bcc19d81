"""Random-init tiny Qwen2.5-VL and Qwen3-VL models for the trainer's tests, built from configs (no download).

Two decoder layers (hidden 64, head_dim 16, `mrope_section` [2, 3, 3]: 8 rotary frequencies split temporal / height /
width; Qwen3-VL interleaves them), a two-block vision tower (hidden 32, 8 x 8 patches, 2 x 2 merge: one image token
per 16 x 16 pixels; Qwen2.5-VL's first block windowed, its second full; Qwen3-VL's first block feeds a deepstack
merger) and the image processor vLLM and the trainer load (`Qwen2VLImageProcessor`, from 256 to 2304 pixels). A
40 x 32 image becomes a (1, 4, 4) grid: 4 image tokens; 48 x 32 a (1, 4, 6) grid: 6 tokens.

The bundled tiny model's tokenizer and chat template come along (so `tidal grpo --dry-run` takes the directory);
the trainer's tests build token ids directly (`VISION_START`, the image's `IMAGE_TOKEN_ID` x its tokens,
`VISION_END`), the way Qwen's chat template and processor expand an image.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tidal.models.sources import bundled

VISION_START, VISION_END, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 100, 101, 103, 104
ARCHS = ("qwen2_5_vl", "qwen3_vl")
TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=64)
PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 8, "merge_size": 2,
             "temporal_patch_size": 2, "min_pixels": 256, "max_pixels": 2304, "image_mean": [0.5, 0.5, 0.5],
             "image_std": [0.5, 0.5, 0.5], "do_resize": True, "do_rescale": True, "do_normalize": True,
             "do_convert_rgb": True}


def build_tiny_qwen_vl(out: Path, arch: str, seed: int = 0) -> Path:
    """Write the tiny `arch` (one of `ARCHS`) model (float32 weights, image processor config) into `out`."""
    import torch
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    ids = dict(image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID, vision_start_token_id=VISION_START,
               vision_end_token_id=VISION_END, tie_word_embeddings=False)
    if arch == "qwen2_5_vl":
        cfg = Qwen2_5_VLConfig(text_config=TEXT, vision_config=dict(VISION, window_size=32, fullatt_block_indexes=[1]),
                               **ids)
        cls: type = Qwen2_5_VLForConditionalGeneration
    elif arch == "qwen3_vl":
        cfg = Qwen3VLConfig(text_config=dict(TEXT, rope_parameters={**TEXT["rope_parameters"],  # type: ignore[dict-item]
                                                                    "mrope_interleaved": True}),
                            vision_config=dict(VISION, num_position_embeddings=64, deepstack_visual_indexes=[0]),
                            **ids)
        cls = Qwen3VLForConditionalGeneration
    else:
        raise ValueError(f"unknown tiny Qwen-VL {arch!r}: one of {ARCHS}")
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32)
    with torch.no_grad():  # logits of order 1: the logprobs depend visibly on the inputs
        model.lm_head.weight.mul_(20.0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)
    (out / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(bundled("tidal:tiny-reverse")) / name, out / name)
    return out
