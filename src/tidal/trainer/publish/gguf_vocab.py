"""GGUF out, the tokenizer: tokens, token types, merges or scores, special ids, flags and llama.cpp's pre-tokenizer
id of a tokenizer.json, as llama.cpp reads them (`tidal.trainer.publish.gguf_out` writes the rest).

Two shapes are written (`tokenizer_kind`): a byte-level BPE (GPT-2 style: Llama 3, Qwen, SmolLM) as llama.cpp's
`gpt2` model with its merges, and a SentencePiece-style BPE (Gemma's: spaces replaced by `▁`, byte fallback to
`<0xXX>` tokens, no pre-tokenizer split) as llama.cpp's `llama` (SPM) model with scores, as llama.cpp's
convert_hf_to_gguf.py writes Gemma's `tokenizer.model`: llama.cpp's SPM merges, of all adjacent pairs whose text is a
token, the one with the highest score, so each token scores minus the rank of the merge that makes it (`spm_scores`:
the BPE merge order), byte tokens 0, added and unused tokens -1000; `add_space_prefix` false (Gemma adds none).

- Token types: llama.cpp matches special tokens in text only for CONTROL and USER_DEFINED tokens, so every added token
  of tokenizer.json is typed from the tokenizer: `special: true` -> CONTROL, else USER_DEFINED, including added tokens
  that are also in the BPE vocabulary (SmolLM2's and Qwen's chat markers; `gguf.vocab.BpeVocab` types those NORMAL,
  so `<|im_start|>` came out as 7 ordinary pieces). In an SPM-style vocabulary `<0xXX>` tokens are BYTE. Other
  vocabulary tokens are NORMAL, padding up to the model's vocabulary UNUSED.
- A model that came from a GGUF file keeps that file's token types, `tokenizer.ggml.pre` and add_bos/add_eos flags
  (and, for an SPM vocabulary, its tokens as spelled there and its scores):
  `models.sources.gguf` stored them in the cache entry (`gguf_tokenizer.json`; merged/ exports copy it), so the source
  file need not exist any more.
- Pre-tokenizer of a Hugging Face tokenizer, chosen as llama.cpp's `convert_hf_to_gguf.py` chooses it: by identity,
  the sha256 of the token ids of llama.cpp's check text (`CHECK_TEXT`) looked up among the families of the
  architectures tidal writes (`PRE_BY_HASH`). A tokenizer no hash names but whose pre-tokenizer is exactly GPT-2's
  byte-level split (optionally after single-digit splitting) or Qwen's split (`QWEN_SPLITS`, Qwen2's or Qwen3.5's
  regex before a byte-level step) gets llama.cpp's id with that same regex (`gpt-2`, `smollm`, `qwen2`, `qwen35`).
  Anything else is refused (ConfigError, exit 2 before training) naming the hash and the known families.
- add_bos / add_eos: what the tokenizer does (`tokenizer_config.json`'s flags, else whether encoding adds them).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tidal.config.load import ConfigError

TOKENIZER_FILE = "gguf_tokenizer.json"
"""A GGUF source's tokenizer facts in its dequantized directory (`tidal.models.sources.gguf.TOKENIZER_FILE`)."""
CHECK_TEXT = (
    '\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated'
    ') ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作131415'
    '1天～ ------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\''
    "s there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
"""llama.cpp's pre-tokenizer check text (`convert_hf_to_gguf.py`'s `chktxt`): whitespace runs, emoji, digit runs,
scripts and contractions, where pre-tokenizers differ."""
PRE_BY_HASH = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": ("llama-bpe", "Llama 3"),
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": ("smollm", "SmolLM / SmolLM2"),
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": ("qwen2", "Qwen1.5 / Qwen2 / Qwen2.5"),
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": ("qwen2", "Qwen3"),
    "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4": ("qwen35", "Qwen3.5"),
    "1444df51289cfa8063b96f0e62b1125440111bc79a52003ea14b6eac7016fd5f": ("qwen35", "Qwen3.5 (MiniCPM-V 4.6)"),
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": ("deepseek-r1-qwen", "DeepSeek-R1 Qwen"),
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": ("tekken", "Mistral Nemo (tekken)"),
    "0e9433cbbb161f89e264eb32e8e64bfe69e834973ffca5d41d3948a604a3e2a3": ("pixtral", "Pixtral / Mistral tekken v7"),
    "9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e": ("falcon3", "Falcon3"),
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": ("deepseek-llm", "DeepSeek LLM"),
    "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821": ("deepseek-coder", "DeepSeek Coder"),
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": ("gpt-2", "GPT-2"),
}
"""sha256 of `str(token ids of CHECK_TEXT)` -> (llama.cpp's `tokenizer.ggml.pre`, the family), for byte-level BPE
tokenizers of Llama / Mistral / Qwen2 / Qwen3 / Qwen3.5 models (the values llama.cpp 0.3.36's converter records:
its `conversion/base.py` `get_vocab_base_pre`)."""
GPT2_SPLIT = {"type": "ByteLevel", "use_regex": True}
"""GPT-2's byte-level pre-tokenizer with its own regex: llama.cpp's `gpt-2` uses the same regex."""
QWEN_SPLITS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+": "qwen35",
}
"""Qwen's pre-tokenizer regexes (a `Split` before a regex-less byte-level step: Qwen2/2.5/3's, and Qwen3.5's, which
keeps combining marks (Unicode category M) with letters) -> the llama.cpp 0.3.36 id with that same regex
(`llama-vocab.cpp`: `qwen2`, `qwen35`). Qwen's tokenizers also normalise to NFC, which llama.cpp does not (its
converter maps them to these ids all the same): text already in NFC tokenizes alike."""
DIGITS = {"type": "Digits", "individual_digits": True}
"""Single-digit splitting before GPT-2's regex: llama.cpp's `smollm` (`\\p{N}`, then GPT-2's regex)."""


def read_record(model_dir: Path) -> dict[str, Any]:
    """The GGUF source's tokenizer facts stored beside the model (`{}`: the model came from no GGUF file)."""
    path = model_dir / TOKENIZER_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def load_tokenizer_json(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "tokenizer.json").read_text())


SPM_SPACE = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
"""Gemma's normalizer: every space becomes `▁` (SentencePiece's escape; llama.cpp's SPM tokenizer does the same)."""
SPACE_SPLIT = {"type": "Split", "pattern": {"String": " "}}
"""A split on spaces, which after `SPM_SPACE` finds none (transformers' Gemma tokenizer read from a GGUF has it)."""


def tokenizer_kind(tok: dict[str, Any]) -> str | None:
    """llama.cpp's tokenizer model for a tokenizer.json: `gpt2` (byte-level BPE), `llama` (SentencePiece-style BPE
    with byte fallback, Gemma's shape: module docstring), None (neither: not written)."""
    model, decoder = tok.get("model") or {}, tok.get("decoder") or {}
    if model.get("type") != "BPE":
        return None
    if not model.get("byte_fallback") and decoder.get("type") == "ByteLevel":
        return "gpt2"
    steps = [d.get("type") for d in decoder.get("decoders") or []] if decoder.get("type") == "Sequence" else []
    pre = tok.get("pre_tokenizer")
    if model.get("byte_fallback") and "ByteFallback" in steps and _matches(tok.get("normalizer"), SPM_SPACE) \
            and (pre is None or _matches(pre, SPACE_SPLIT)):
        return "llama"
    return None


def _matches(step: dict[str, Any] | None, want: dict[str, Any]) -> bool:
    return step is not None and all(step.get(k) == v for k, v in want.items())


def qwen_pre(tok: dict[str, Any]) -> str | None:
    """`qwen2` / `qwen35` for a tokenizer whose pre-tokenizer is one of Qwen's splits (`QWEN_SPLITS`, isolated, not
    inverted) then a byte-level step without its own regex nor prefix space, under no normalizer or NFC."""
    pre, norm = tok.get("pre_tokenizer") or {}, tok.get("normalizer")
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if norm is not None and norm.get("type") != "NFC" or not steps or len(steps) != 2:
        return None
    split, byte = steps
    if split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert"):
        return None
    if not _matches(byte, {"type": "ByteLevel", "use_regex": False}) or byte.get("add_prefix_space"):
        return None
    return QWEN_SPLITS.get(str((split.get("pattern") or {}).get("Regex")))


def structural_pre(tok: dict[str, Any]) -> str | None:
    """llama.cpp's id for a tokenizer whose pre-tokenizer is exactly GPT-2's split (`gpt-2`) or single digits then
    GPT-2's split (`smollm`), with no normalizer, or one of Qwen's splits (`qwen_pre`); None otherwise."""
    if qwen_pre(tok) is not None:
        return qwen_pre(tok)
    pre = tok.get("pre_tokenizer")
    if tok.get("normalizer") is not None or pre is None:
        return None
    if _matches(pre, GPT2_SPLIT) and not pre.get("add_prefix_space"):
        return "gpt-2"
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if steps and len(steps) == 2 and _matches(steps[0], DIGITS) and _matches(steps[1], GPT2_SPLIT) \
            and not steps[1].get("add_prefix_space"):
        return "smollm"
    return None


def check_hash(model_dir: Path) -> str:
    """The sha256 llama.cpp identifies a tokenizer by: of `str(ids)`, ids = the tokenizer's encoding of CHECK_TEXT
    (special tokens added as the tokenizer adds them)."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(CHECK_TEXT).ids
    return hashlib.sha256(str(list(ids)).encode()).hexdigest()


def choose_pre(model_dir: Path, source: str = "train export.gguf") -> str:
    """llama.cpp's pre-tokenizer id for the tokenizer of `model_dir` (module docstring), or ConfigError."""
    record = read_record(model_dir)
    if record.get("pre"):
        return str(record["pre"])
    if tokenizer_kind(load_tokenizer_json(model_dir)) == "llama":
        return "default"  # SPM has no pre-tokenizer
    digest = check_hash(model_dir)
    if digest in PRE_BY_HASH:
        return PRE_BY_HASH[digest][0]
    tok = load_tokenizer_json(model_dir)
    found = structural_pre(tok)
    if found is not None:
        return found
    families = ", ".join(sorted({f"{fam} ({pre})" for pre, fam in PRE_BY_HASH.values()}))
    raise ConfigError(
        f"{source}: the tokenizer of {model_dir} is none whose pre-tokenizer llama.cpp would know: its check hash "
        f"{digest[:16]}... names no family tidal writes ({families}), and its pre-tokenizer "
        f"({json.dumps(tok.get('pre_tokenizer'))[:160]}, normalizer {(tok.get('normalizer') or {}).get('type')}) is "
        "not GPT-2's byte-level split; a GGUF with a guessed pre-tokenizer would tokenize differently in llama.cpp. "
        "Set export.gguf: null and convert final/merged/ with llama.cpp's convert_hf_to_gguf.py (newer versions "
        "know more families)")


def vocab_tokens(tok: dict[str, Any], vocab_size: int, spm: bool = False) -> tuple[list[str], list[int]]:
    """(tokens by id, gguf.TokenType per token): vocabulary NORMAL (`<0xXX>` BYTE when `spm`), added tokens CONTROL
    (special) or USER_DEFINED, ids without a token and the padding up to `vocab_size` UNUSED."""
    import re

    import gguf

    def kind(t: str) -> int:
        return gguf.TokenType.BYTE if spm and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", t) else gguf.TokenType.NORMAL

    by_id: dict[int, tuple[str, int]] = {int(i): (t, kind(t)) for t, i in tok["model"]["vocab"].items()}
    for added in tok.get("added_tokens") or []:
        typ = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        by_id[int(added["id"])] = (added["content"], typ)
    n = max(vocab_size, max(by_id) + 1)
    if n > vocab_size:
        raise ValueError(f"GGUF export: the tokenizer has token id {max(by_id)} but the model's vocab_size is "
                         f"{vocab_size}")
    tokens = [by_id.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED))[0] for i in range(n)]
    types = [int(by_id.get(i, ("", gguf.TokenType.UNUSED))[1]) for i in range(n)]
    return tokens, types


def special_flags(model_dir: Path, tok: dict[str, Any]) -> dict[str, bool]:
    """add_bos_token / add_eos_token: tokenizer_config.json's when it says, else whether encoding adds a token."""
    from tokenizers import Tokenizer

    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    t = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    plain, added = t.encode("a", add_special_tokens=False).ids, t.encode("a", add_special_tokens=True).ids
    out = {"add_bos_token": added[:1] != plain[:1], "add_eos_token": added[-1:] != plain[-1:]}
    for key in out:
        if isinstance(cfg.get(key), bool):
            out[key] = cfg[key]
    return out


def spm_scores(tok: dict[str, Any], tokens: list[str], types: list[int]) -> list[float]:
    """One score per token for llama.cpp's SPM merging (module docstring): minus the rank of the first merge that
    makes a NORMAL token (one no merge makes: below them all), 0 for BYTE tokens, -1000 for the others."""
    import gguf

    rank: dict[str, int] = {}
    for i, merge in enumerate(tok["model"].get("merges") or []):
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        rank.setdefault(left + right, i)
    n = len(rank) + 1
    out = []
    for i, (t, typ) in enumerate(zip(tokens, types, strict=True)):
        if typ == gguf.TokenType.NORMAL:
            out.append(-float(rank[t]) if t in rank else -float(n + i))
        else:
            out.append(0.0 if typ == gguf.TokenType.BYTE else -1000.0)
    return out


def add_tokenizer(w: Any, model_dir: Path, vocab_size: int) -> None:
    """Write the tokenizer of `model_dir` (byte-level BPE or SentencePiece-style: module docstring) into the GGUF
    writer `w`."""
    from gguf.vocab import SpecialVocab

    tok = load_tokenizer_json(model_dir)
    record = read_record(model_dir)
    spm = tokenizer_kind(tok) == "llama"
    tokens, types = vocab_tokens(tok, vocab_size, spm)
    scores = None
    if spm and record.get("model") == "llama" and len(record.get("tokens") or []) == len(tokens) \
            and len(record.get("scores") or []) == len(tokens):
        tokens, scores = list(record["tokens"]), [float(x) for x in record["scores"]]  # the source file's own
    if record.get("token_types"):
        src = [int(t) for t in record["token_types"]]
        if len(src) != len(tokens):
            raise ValueError(f"GGUF export: {model_dir / TOKENIZER_FILE} has {len(src)} token types for "
                             f"{len(tokens)} tokens")
        types = src
    w.add_tokenizer_model("llama" if spm else "gpt2")
    w.add_tokenizer_pre(choose_pre(model_dir))
    w.add_token_list(tokens)
    if spm:
        w.add_token_scores(scores if scores is not None else spm_scores(tok, tokens, types))
        w.add_add_space_prefix(False)
    w.add_token_types(types)
    special = SpecialVocab(model_dir, load_merges=not spm, n_vocab=vocab_size)
    template = model_dir / "chat_template.jinja"
    if special.chat_template is None and template.is_file():
        special.chat_template = template.read_text()
    special.add_special_token = {}  # written below, once
    special.add_to_gguf(w, quiet=True)
    flags = special_flags(model_dir, tok)
    for key in flags:
        if isinstance(record.get(key), bool):
            flags[key] = record[key]
    w.add_add_bos_token(flags["add_bos_token"])
    w.add_add_eos_token(flags["add_eos_token"])
