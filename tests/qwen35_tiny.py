"""Random-init tiny Qwen3.5 text models with a Qwen3.5-shaped tokenizer, for the GGUF-out checks
(tests/unit/test_gguf_qwen35.py, tests/e2e/test_gguf_qwen35_llama_cpp.py). No download.

The tokenizer is built as transformers' `Qwen3_5Tokenizer` builds one (its `PRETOKENIZE_REGEX` split, then a
byte-level step without regex, NFC normalizer, byte-level decoder; llama.cpp 0.3.36 calls that pre-tokenizer `qwen35`),
its 256 byte symbols plus merges learned from a few sentences (`tokenizers`' trainer), Qwen's specials
`<|endoftext|>`, `<|im_start|>`, `<|im_end|>` at ids 0-2 and a non-special added `<think>`, and a ChatML template.
(The bundled tiny model's tokenizer is a plain BPE without byte-level pieces: not Qwen's, and not writable as GGUF.)

The models (`build`): Qwen3.5 text configs, hidden 128, 3 layers `linear_attention, full_attention,
linear_attention` (not transformers' default period of 4, so the per-layer flags are what the check sees), full
attention with 4 query / 2 KV heads of 32 (gated q_proj, partial RoPE: 8 rotated dimensions), the gated delta-net
with 2 key heads and 4 value heads (`qwen3.5`: llama.cpp's V-head reorder is needed) or 2 and 2 (`qwen3.5-kv-equal`,
untied output), heads of 32, a 4-wide convolution; `qwen3.5-moe` is a Qwen3.5-MoE text model of the same shape with
4 experts of 64 (top 2) and a shared expert of 96 in every layer. Weights drawn with std 0.3 (peaked logits: greedy
choices float rounding does not flip), the norms (which transformers' Qwen3.5 initialises to 0, scale 1 + w) and the
gated norm perturbed so a dropped +1 shows, `A_log` and `dt_bias` drawn per head so a dropped reorder shows; float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["What is 12 + 30? Answer with a number.", "the quick brown fox jumps over the lazy dog",
          "reverse the text: hello world", "Sort these words: apple, banana, cherry.",
          "user assistant system <|im_start|> <|im_end|>", "ünïcode naïve café 🦙 3.14"]


def qwen35_tokenizer(out: Path, vocab: int = 500) -> int:
    """Write the Qwen3.5-shaped tokenizer (module docstring) into `out`; returns its size."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token=None, bos_token=None)
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(out))
    return int(tok.get_vocab_size())


CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3.5": {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "tie_word_embeddings": True},
    "qwen3.5-kv-equal": {"linear_num_key_heads": 2, "linear_num_value_heads": 2, "tie_word_embeddings": False},
    "qwen3.5-moe": {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "tie_word_embeddings": False,
                    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                    "shared_expert_intermediate_size": 96},
}
"""Tiny Qwen3.5 configs by name (on top of the shared widths in `build`)."""


def build(name: str, out: Path, seed: int = 0, std: float = 0.3) -> Any:
    """Write the random-init tiny model `name` (`CONFIGS`) with `qwen35_tokenizer` into `out`; returns the model."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    out.mkdir(parents=True, exist_ok=True)
    vocab = qwen35_tokenizer(out)
    moe = "num_experts" in CONFIGS[name]
    cfg = (Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig)(
        **({} if moe else {"intermediate_size": 256}),
        vocab_size=vocab, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention"], bos_token_id=None, eos_token_id=2,
        pad_token_id=0, initializer_range=std, **CONFIGS[name])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):  # 0 (x 1 + w) or 1 (the gated norm) at init: make them matter
                p.add_(torch.randn_like(p) * 0.2)
            elif n.endswith(".A_log"):  # log decay per value head, different per head
                p.copy_(torch.linspace(-2.0, 1.0, p.numel())[torch.randperm(p.numel())])
            elif n.endswith(".dt_bias"):
                p.copy_(torch.randn_like(p))
    model.save_pretrained(str(out))
    return model
