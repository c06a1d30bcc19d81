"""GGUF out: a model's weights (checkpoint names) + its HF directory's config and tokenizer -> one GGUF file, F32 or
F16, that llama.cpp-based tools (llama.cpp, Ollama, LM Studio) and transformers + gguf load (train `export.gguf`).

What is written, and why by hand: neither transformers (it reads GGUF only) nor PyPI's `gguf` (a writer of keys and
tensors, plus llama.cpp's tensor-name table `gguf.TensorNameMap`) converts an HF checkpoint; llama.cpp's
`convert_hf_to_gguf.py` does, but it is a script outside any package. So this module writes what that script writes
for the architectures listed in `ARCHS`, with the names from `gguf.TensorNameMap` (not a table of our own):
- hyperparameters under `{arch}.*` (blocks, context, widths, heads, rope base and dimension, RMS-norm epsilon);
- the tokenizer of a byte-level BPE tokenizer.json (`gpt2` model: tokens, types, merges, special ids, the chat
  template): what transformers' GGUF tokenizer converter and llama.cpp read. `tokenizer.ggml.pre` (llama.cpp's
  pre-tokenizer id) is taken from the source GGUF when the model came from one (`tidal.gguf_source`), else `default`;
- tensors: F16 for matrices and F32 for 1-d tensors (norms) with `f16`, all F32 with `f32`; tied embeddings once
  (`token_embd`, no `output`). Llama: llama.cpp applies rotary embeddings to interleaved pairs, HF to the two halves
  of each head, so q/k rows are reordered per head (`rope_interleave`); transformers' GGUF reader undoes exactly this.

`check_gguf_export` refuses (exit 2, before training) a model this writer cannot express.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import numpy as np

from tidal.config.load import ConfigError

ARCHS = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3"}
"""HF `model_type` -> gguf's `MODEL_ARCH` member (Mistral is llama.cpp's `llama` architecture)."""
PERMUTED = {"llama", "mistral"}
"""Architectures whose q/k rows llama.cpp expects in interleaved rotary order."""


def tokenizer_problem(model_dir: Path) -> str | None:
    """Why the tokenizer of `model_dir` cannot go into a GGUF (None: it can): a byte-level BPE tokenizer.json."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return "it has no tokenizer.json"
    tok = json.loads(path.read_text())
    model, decoder = tok.get("model") or {}, tok.get("decoder") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or decoder.get("type") != "ByteLevel":
        return (f"its tokenizer is {model.get('type')} with a {decoder.get('type')} decoder; GGUF export writes "
                "byte-level BPE tokenizers (GPT-2 style: Llama 3, Qwen, SmolLM)")
    return None


def check_gguf_export(config: dict[str, Any], model_dir: Path, source: str) -> None:
    """Refuse train `export.gguf` for a model this writer cannot write (ConfigError naming what is supported)."""
    mt = config.get("model_type")
    if mt not in ARCHS:
        raise ConfigError(f"{source}: key 'export.gguf': model_type '{mt}' cannot be written as GGUF by tidal; "
                          f"supported: {', '.join(sorted(ARCHS))} (or set export.gguf: null and convert "
                          "final/merged/ with llama.cpp's convert_hf_to_gguf.py)")
    why = tokenizer_problem(model_dir)
    if why is not None:
        raise ConfigError(f"{source}: key 'export.gguf': model {model_dir}: {why}")


def rope_interleave(w: np.ndarray, n_head: int) -> np.ndarray:
    """(n_head*D, ...) rows of q or k from HF's rotate-half layout (per head: D/2 first halves, then D/2 second
    halves) to llama.cpp's interleaved layout (pairs (x_i, x_{i+D/2}) adjacent)."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_hparams(w: Any, cfg: dict[str, Any], name: str) -> None:
    """The `{arch}.*` hyperparameters of an HF config.json."""
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    rope = cfg.get("rope_parameters") or {}
    w.add_name(name)
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_context_length(int(cfg.get("max_position_embeddings", 2048)))
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(heads)
    w.add_head_count_kv(int(cfg.get("num_key_value_heads") or heads))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(int(cfg["vocab_size"]))


def source_pre(model_dir: Path) -> str:
    """llama.cpp's pre-tokenizer id: the source GGUF's (`gguf_source.json`), else `default`."""
    src = model_dir / "gguf_source.json"
    if src.is_file():
        import gguf

        field = gguf.GGUFReader(json.loads(src.read_text())["file"]).fields.get("tokenizer.ggml.pre")
        if field is not None:
            return str(field.contents())
    return "default"


def add_tokenizer(w: Any, model_dir: Path, vocab_size: int) -> None:
    """The byte-level BPE tokenizer of `model_dir` (padded with unused tokens up to the model's vocabulary)."""
    import gguf
    from gguf.vocab import BpeVocab, SpecialVocab

    vocab = BpeVocab(model_dir)
    tokens, types = [], []
    for text, _score, typ in vocab.all_tokens():
        tokens.append(text)
        types.append(typ)
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]".encode())
        types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(source_pre(model_dir))
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size)
    template = model_dir / "chat_template.jinja"
    if special.chat_template is None and template.is_file():
        special.chat_template = template.read_text()
    special.add_to_gguf(w, quiet=True)


def gguf_tensors(weights: Iterable[tuple[str, Any]], cfg: dict[str, Any],
                 dtype: Literal["f16", "f32"]) -> Iterable[tuple[str, np.ndarray]]:
    """(GGUF name, array) for each (checkpoint name, tensor): names from gguf's table, q/k reordered for llama."""
    import gguf

    arch = getattr(gguf.MODEL_ARCH, ARCHS[cfg["model_type"]])
    names = gguf.TensorNameMap(arch, int(cfg["num_hidden_layers"]))
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    tied = bool(cfg.get("tie_word_embeddings", False))
    for key, tensor in weights:
        if tied and key == "lm_head.weight":
            continue
        new = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ValueError(f"GGUF export: tensor {key} has no name in gguf's {cfg['model_type']} table")
        a = tensor.detach().to("cpu").float().numpy() if hasattr(tensor, "detach") else np.asarray(tensor, np.float32)
        if cfg["model_type"] in PERMUTED and key.endswith(("q_proj.weight", "k_proj.weight")):
            a = rope_interleave(a, heads if key.endswith("q_proj.weight") else kv_heads)
        yield new, (a.astype(np.float16) if dtype == "f16" and a.ndim > 1 else a.astype(np.float32))


def write_gguf(weights: Iterable[tuple[str, Any]], model_dir: Path, out: Path,
               dtype: Literal["f16", "f32"]) -> Path:
    """Write `weights` (checkpoint names -> tensors) with `model_dir`'s config.json and tokenizer as the GGUF file
    `out` (through a temporary name and a rename)."""
    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    check_gguf_export(cfg, model_dir, str(model_dir / "config.json"))
    arch = getattr(gguf.MODEL_ARCH, ARCHS[cfg["model_type"]])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    w = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[arch])
    add_hparams(w, cfg, out.stem)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
    add_tokenizer(w, model_dir, int(cfg["vocab_size"]))
    for name, array in gguf_tensors(weights, cfg, dtype):
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)
    return out
