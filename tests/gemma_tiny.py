"""Random-init tiny Gemma models with a Gemma-shaped tokenizer, for the GGUF-out checks (tests/unit/test_gguf_gemma.py,
tests/e2e/test_gguf_gemma_llama_cpp.py). No download.

The tokenizer is shaped like Gemma's tokenizer.json (what a Gemma checkpoint ships and what transformers makes of a
Gemma GGUF): a BPE over SentencePiece-escaped text (the normalizer replaces spaces by `▁`, no pre-tokenizer split),
byte fallback to the 256 `<0xXX>` tokens, `<pad> <eos> <bos> <unk> <mask>` at ids 0-4 (as Gemma's) and the chat
markers `<start_of_turn>` / `<end_of_turn>` (special), a non-special added `<tool>`, BOS added on encoding, merges
learned from a few sentences (`tokenizers`' trainer), a Gemma-style chat template. The models (`build`) are Gemma,
Gemma 2, Gemma 3 and Gemma 4 text configs at 3 layers (Gemma 4: 4, its global layers with its own head size 64 and 1
KV head, proportional RoPE on a quarter of it), hidden 128, head_dim 32, a sliding window of 8 tokens on the layers
`layer_types` says (so prompts of ~30 tokens use it), weights drawn with std 0.3 (peaked logits: greedy choices that
float rounding does not flip), float32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
            "m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
            "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
CORPUS = ["What is 12 + 30? Answer with a number.", "the quick brown fox jumps over the lazy dog",
          "reverse the text: hello world", "Sort these words: apple, banana, cherry.",
          "user model <start_of_turn> <end_of_turn>"]
WINDOW = 8


def gemma_tokenizer(out: Path, vocab: int = 420) -> int:
    """Write the Gemma-shaped tokenizer (module docstring) into `out`; returns its size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    learner = Tokenizer(models.BPE())
    learner.normalizer = normalizers.Replace(" ", "▁")
    learner.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(vocab_size=vocab - len(SPECIALS) - 256,
                                                                    show_progress=False))
    learned = json.loads(learner.to_str())["model"]
    ids = SPECIALS + [f"<0x{b:02X}>" for b in range(256)]
    ids += [t for t, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]) if t not in ids]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(ids)}, merges=merges, unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", add_bos_token=True)
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(out))
    return int(tok.get_vocab_size())


CONFIGS: dict[str, dict[str, Any]] = {
    "gemma3": {"model_type": "gemma3_text", "query_pre_attn_scalar": 32, "sliding_window": WINDOW,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
               "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
               "final_logit_softcapping": 30.0, "tie_word_embeddings": False},
    "gemma3-tied": {"model_type": "gemma3_text", "query_pre_attn_scalar": 32, "sliding_window": WINDOW,
                    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
    "gemma2": {"model_type": "gemma2", "query_pre_attn_scalar": 32, "sliding_window": WINDOW,
               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "rope_parameters":
               {"rope_type": "default", "rope_theta": 1e4}},
    "gemma": {"model_type": "gemma", "hidden_activation": "gelu_pytorch_tanh",
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
    "gemma4": {"model_type": "gemma4_text", "sliding_window": WINDOW, "hidden_size_per_layer_input": 0,
               "num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
               "per_layer_config": {str(i): {"head_dim": 64, "num_key_value_heads": 1} for i in (1, 3)},
               "rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                      "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
               "final_logit_softcapping": 30.0, "tie_word_embeddings": True},
}
"""Tiny Gemma configs by name (on top of the shared widths in `build`)."""


def build(name: str, out: Path, seed: int = 0, std: float = 0.3) -> Any:
    """Write the random-init tiny model `name` (`CONFIGS`) with `gemma_tokenizer` into `out`; returns the model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    vocab = gemma_tokenizer(out)
    fields = {"vocab_size": vocab, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512,
              "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "initializer_range": std, **CONFIGS[name]}
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # Gemma initialises its norms to 0 (scale 1 + w): make them matter
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
        for n, b in model.named_buffers():
            if n.endswith("layer_scalar"):  # Gemma 4's per-layer output scale
                b.fill_(0.8)
    model.save_pretrained(str(out))
    return model
