"""GGUF out: a model's weights (checkpoint names) + its HF directory's config and tokenizer -> one GGUF file that
llama.cpp-based tools (llama.cpp, Ollama, LM Studio) and transformers + gguf load (train `export.gguf`).

What is written, and why by hand: neither transformers (it reads GGUF only) nor PyPI's `gguf` (a writer of keys and
tensors, plus llama.cpp's tensor-name table `gguf.TensorNameMap` and numpy quantizers `gguf.quants`) converts an HF
checkpoint; llama.cpp's `convert_hf_to_gguf.py` does, but it is a script outside any package. So this module writes
what that script writes for the architectures listed in `ARCHS`, with the names from `gguf.TensorNameMap`:
- hyperparameters under `{arch}.*` (blocks, context, widths, heads, rope base and dimension, RMS-norm epsilon) and
  RoPE scaling as llama.cpp reads it: `linear` (type, factor), `yarn` (type, factor, original context),
  `llama3` (Llama/Mistral: the per-frequency factors as the `rope_freqs` tensor, as the script computes them).
  What llama.cpp would not read for these architectures is refused before training (`hparam_problems`, naming the
  config key): other RoPE types, non-default YaRN attention factor / betas, a sliding window that is in effect,
  an activation other than SiLU, partial rotary dimensions, per-layer-type RoPE (the Gemma family's and Qwen3.5's
  own rules: `gguf_gemma`, `gguf_qwen35`);
- the tokenizer (`tidal.trainer.publish.gguf_vocab`: token types, pre-tokenizer, merges, special ids, template);
- tensors in `TYPES`: 1-d tensors (norms, biases) stay F32; matrices in the chosen type. The quantized types are the
  ones gguf's own numpy quantizers write (`gguf.quants.quantize`): Q8_0, Q5_0/Q5_1, Q4_0/Q4_1 (blocks of 32
  values, one scale each); with them the embedding/output matrix is written Q8_0, as llama.cpp's quantizer keeps the
  output layer above the 4/5-bit type (it uses Q6_K, which gguf cannot write), and a matrix whose rows are not a
  multiple of 32 falls back to F16 (as the script does); a delta-net's conv kernel stays F32 (`F32_ALWAYS`). Tied
  embeddings once (`token_embd`, no `output`). Llama:
  llama.cpp applies rotary embeddings to interleaved pairs, HF to the two halves of each head, so q/k rows (weights
  and biases) are reordered per head (`rope_interleave`); transformers' GGUF reader undoes exactly this.

`check_gguf_export` refuses (exit 2, before training) a model this writer cannot express.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tidal.config.load import ConfigError
from tidal.trainer.publish.gguf_gemma import (
    GEMMA_TYPES,
    NORM_SHIFT,
    add_gemma_hparams,
    full_head_dim,
    gemma_problems,
    kv_heads,
    proportional_freqs,
)
from tidal.trainer.publish.gguf_qwen35 import QWEN35_TYPES, add_qwen35_hparams, qwen35_arrays, qwen35_problems

ARCHS = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "gemma": "GEMMA",
         "gemma2": "GEMMA2", "gemma3_text": "GEMMA3", "gemma4_text": "GEMMA4", "qwen3_5_text": "QWEN35",
         "qwen3_5_moe_text": "QWEN35MOE"}
"""What tidal writes as GGUF: HF `model_type` -> gguf's `MODEL_ARCH` member (Mistral is llama.cpp's `llama`
architecture; the Gemma family's rules are `tidal.trainer.publish.gguf_gemma`, Qwen3.5's
`tidal.trainer.publish.gguf_qwen35`). The one list of the GGUF-out support
(with `TEXT_OF` and `NOT_WRITTEN`): docs/models.md's family table reads it."""
TEXT_OF = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "qwen3_5": "qwen3_5_text",
           "qwen3_5_moe": "qwen3_5_moe_text"}
"""Vision-language `model_type` -> its language model's, written from `text_config` (the vision tower left out)."""
NOT_WRITTEN = {
    "qwen3_next": "llama.cpp 0.3.36 reads qwen3next, but tidal does not write it (its fused in_proj_qkvz and "
                  "in_proj_ba delta-net projections and its experts)",
}
"""`model_type`s llama.cpp could run that tidal does not write (why), refused with that reason."""


def gguf_out_support(model_type: str) -> tuple[bool, str]:
    """(written, what to show) for a config.json `model_type`: the family table's "GGUF out" cell. Written: llama.cpp's
    architecture name (a VLM: its text model's); not: why (`NOT_WRITTEN`), else that tidal does not write it."""
    text = TEXT_OF.get(model_type, model_type)
    if text in ARCHS:
        name = ARCHS[text].lower()
        return True, name if text == model_type else f"{name} (text model)"
    return False, NOT_WRITTEN.get(model_type, "not written by tidal (llama.cpp's convert_hf_to_gguf.py may know it)")
PERMUTED = {"llama", "mistral"}
"""Architectures whose q/k rows llama.cpp expects in interleaved rotary order (and that read `rope_freqs`)."""
TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
"""train `export.gguf` values: the matrix type of the file (`tidal.config.train.ExportSection.gguf`)."""
QUANTIZED = {"q8_0", "q5_1", "q5_0", "q4_1", "q4_0"}
"""The block-quantized types (32 values per block); their embedding/output matrix is Q8_0."""
INSTALL = "pip install gguf (tidal's extra: pip install -e '.[gguf]')"


def tokenizer_problem(model_dir: Path) -> str | None:
    """Why the tokenizer of `model_dir` cannot go into a GGUF (None: it can): a byte-level BPE or a
    SentencePiece-style BPE tokenizer.json (`gguf_vocab.tokenizer_kind`)."""
    from tidal.trainer.publish.gguf_vocab import tokenizer_kind

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return "it has no tokenizer.json"
    tok = json.loads(path.read_text())
    model, decoder = tok.get("model") or {}, tok.get("decoder") or {}
    if tokenizer_kind(tok) is None:
        return (f"its tokenizer is {model.get('type')} with a {decoder.get('type')} decoder; GGUF export writes "
                "byte-level BPE tokenizers (GPT-2 style: Llama 3, Qwen, SmolLM) and SentencePiece-style BPE ones "
                "with byte fallback (Gemma)")
    return None


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config llama.cpp's text model is written from: a vision-language model's `text_config` (`TEXT_OF`), with
    its `model_type` and tying; the config itself otherwise."""
    mt = config.get("model_type")
    if mt not in TEXT_OF:
        return config
    text = {"model_type": TEXT_OF[mt], **(config.get("text_config") or {})}
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", True))
    return text


def rope_params(cfg: dict[str, Any], overlay: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config's RoPE parameters as one dict (`rope_parameters`, or the older `rope_scaling` + `rope_theta`),
    with train `rope_scaling` (`overlay`) merged over them and the legacy `type` read as `rope_type`."""
    rope = dict(cfg.get("rope_parameters") or {})
    if not rope:
        rope = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 10000.0)}
    rope.update(overlay or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    return rope


def hparam_problems(cfg: dict[str, Any], overlay: dict[str, Any] | None = None) -> list[str]:
    """What of the config llama.cpp would not read for this architecture (each names its config key); [] when
    everything the model does is written."""
    mt, out = cfg.get("model_type"), []
    if mt in GEMMA_TYPES:
        return gemma_problems(cfg, overlay)
    if mt in QWEN35_TYPES:
        return qwen35_problems(cfg, overlay)
    rope = rope_params(cfg, overlay)
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return ["rope_parameters: per-layer-type RoPE is not written for " + str(mt)]
    kind = str(rope.get("rope_type") or "default").lower()
    if kind == "llama3" and mt not in PERMUTED:
        out.append(f"rope_parameters.rope_type 'llama3' on {mt} (llama.cpp reads its rope_freqs for llama only)")
    elif kind == "yarn":
        for key, default in (("attention_factor", None), ("mscale", None), ("mscale_all_dim", None),
                             ("beta_fast", 32.0), ("beta_slow", 1.0), ("truncate", True)):
            if rope.get(key) is not None and rope[key] != default:
                out.append(f"rope_parameters.{key} {rope[key]} (llama.cpp's yarn for {mt} uses "
                           f"{'the factor-derived value' if default is None else default})")
        if rope.get("original_max_position_embeddings") is None:
            out.append("rope_parameters.original_max_position_embeddings (yarn needs it)")
    elif kind not in ("default", "linear", "llama3"):
        out.append(f"rope_parameters.rope_type '{kind}' (written: default, linear, yarn, llama3 for llama/mistral)")
    if kind in ("linear", "yarn", "llama3") and not rope.get("factor"):
        out.append(f"rope_parameters.factor (rope_type {kind} needs it)")
    if float(cfg.get("partial_rotary_factor") or 1.0) != 1.0:
        out.append(f"partial_rotary_factor {cfg['partial_rotary_factor']} (llama.cpp rotates the whole head here)")
    if cfg.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act '{cfg.get('hidden_act')}' (llama.cpp's {mt} uses silu)")
    window = cfg.get("sliding_window")
    ctx = int(cfg.get("max_position_embeddings", 2048))
    if mt == "mistral" and window is not None and int(window) < ctx:
        out.append(f"sliding_window {window} < max_position_embeddings {ctx} (llama.cpp's llama architecture "
                   "attends to the whole context)")
    if mt in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        out.append(f"use_sliding_window true (llama.cpp's {mt} attends to the whole context)")
    if "sliding_attention" in (cfg.get("layer_types") or []) and not out:
        out.append(f"layer_types with sliding_attention (llama.cpp's {mt} attends to the whole context)")
    return out


def check_gguf_export(config: dict[str, Any], model_dir: Path, source: str,
                      rope_scaling: dict[str, Any] | None = None) -> None:
    """Refuse train `export.gguf` for a model this writer cannot write, or without the `gguf` package (ConfigError
    naming the key and what is supported)."""
    key = f"{source}: key 'export.gguf'"
    try:
        import gguf  # noqa: F401 - the writer's package, checked before training rather than after it
    except ImportError as exc:
        raise ConfigError(f"{key}: writing a GGUF file needs the `gguf` package, which cannot be imported "
                          f"({exc}); {INSTALL}") from None
    config = text_config(config)
    mt = config.get("model_type")
    if mt not in ARCHS:
        why = NOT_WRITTEN.get(str(mt), "llama.cpp's converter knows more architectures than tidal writes")
        written = ", ".join([*ARCHS, *(f"{k} (its text model)" for k in TEXT_OF)])
        raise ConfigError(f"{key}: model {model_dir}: model_type '{mt}' cannot be written as GGUF by tidal: {why}; "
                          f"supported: {written}. Set export.gguf: null (final/adapter "
                          "and final/merged/ keep the model) and convert final/merged/ with llama.cpp's "
                          "convert_hf_to_gguf.py")
    problem = tokenizer_problem(model_dir)
    if problem is not None:
        raise ConfigError(f"{key}: model {model_dir}: {problem}")
    problems = hparam_problems(config, rope_scaling)
    if problems:
        raise ConfigError(f"{key}: model {model_dir}: llama.cpp would run another model than the one trained: "
                          f"{'; '.join(problems)}. Set export.gguf: null (final/adapter and final/merged/ keep "
                          "the model)")
    from tidal.trainer.publish.gguf_vocab import choose_pre

    choose_pre(model_dir, key)


def rope_interleave(w: np.ndarray, n_head: int) -> np.ndarray:
    """(n_head*D, ...) rows of q or k from HF's rotate-half layout (per head: D/2 first halves, then D/2 second
    halves) to llama.cpp's interleaved layout (pairs (x_i, x_{i+D/2}) adjacent)."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))


def add_hparams(w: Any, cfg: dict[str, Any], name: str, rope: dict[str, Any],
                overlay: dict[str, Any] | None = None) -> None:
    """The `{arch}.*` hyperparameters of an HF config.json, RoPE scaling included (`rope`: `rope_params`; the Gemma
    family's from the config and train `rope_scaling`, `overlay`)."""
    import gguf

    heads = int(cfg["num_attention_heads"])
    w.add_name(name)
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_context_length(int(cfg.get("max_position_embeddings", 2048)))
    w.add_embedding_length(int(cfg["hidden_size"]))
    if cfg.get("intermediate_size") is not None:  # an MoE's experts have their own (Qwen3.5-MoE has none)
        w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads(cfg))
    w.add_key_length(full_head_dim(cfg))
    w.add_value_length(full_head_dim(cfg))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(int(cfg["vocab_size"]))
    if cfg["model_type"] in QWEN35_TYPES:  # partial rotary dimensions, MRoPE sections, the delta-net's sizes
        add_qwen35_hparams(w, cfg)
        return
    w.add_rope_dimension_count(full_head_dim(cfg))
    if cfg["model_type"] in GEMMA_TYPES:
        add_gemma_hparams(w, cfg, overlay)
        return
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    kind = str(rope.get("rope_type") or "default").lower()
    if kind in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if kind == "linear" else gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
    if kind == "yarn":
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))


def llama3_rope_factors(rope: dict[str, Any], dim: int) -> np.ndarray:
    """(dim/2,) float32: the divisor of each rotary frequency under `rope_type: llama3` (1 above the high-frequency
    wavelength, `factor` below the low one, a smooth blend between), llama.cpp's `rope_freqs` tensor."""
    base, factor = float(rope.get("rope_theta", 10000.0)), float(rope["factor"])
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old = float(rope.get("original_max_position_embeddings", 8192))
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


F32_ALWAYS = ("ssm_conv1d.weight",)
"""Matrices kept F32 in every type: llama.cpp's CPU `ssm_conv` reads an F32 kernel only (its converter keeps it F32)."""


def encode(name: str, a: np.ndarray, dtype: str) -> tuple[np.ndarray, Any]:
    """(data, gguf.GGMLQuantizationType) of the tensor `name` in the file's type `dtype` (module docstring)."""
    import gguf
    from gguf.quants import QuantError, quantize

    Q = gguf.GGMLQuantizationType
    if a.ndim < 2 or dtype == "f32" or name.endswith(F32_ALWAYS):
        return a.astype(np.float32), Q.F32
    qtype = {"f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q5_1": Q.Q5_1, "q5_0": Q.Q5_0, "q4_1": Q.Q4_1,
             "q4_0": Q.Q4_0}[dtype]
    if dtype in QUANTIZED and dtype != "q8_0" and name in ("token_embd.weight", "output.weight"):
        qtype = Q.Q8_0
    if qtype == Q.F16:
        return a.astype(np.float16), Q.F16
    try:
        return quantize(a.astype(np.float32), qtype), qtype
    except QuantError:  # rows not a multiple of the block size
        return a.astype(np.float16), Q.F16


LEFT_OUT = ("mtp.",)
"""Checkpoint tensors not written: Qwen3.5's multi-token-prediction head (transformers does not load it, so tidal
does not train it; `tidal.trainer.publish.gguf_qwen35`)."""
TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head."))
"""A vision-language checkpoint's language-model names (transformers 5's, then 4's) -> a causal LM's."""


def text_name(key: str, vlm: bool) -> str | None:
    """The causal-LM name of checkpoint tensor `key` (a VLM's vision tower and projector: None, not written)."""
    if not vlm:
        return key
    for old, new in TEXT_PREFIXES:
        if key.startswith(old):
            return new + key[len(old):]
    return key if key.startswith("lm_head.") else None


def text_arrays(weights: Iterable[tuple[str, Any]], cfg: dict[str, Any],
                vlm: bool) -> Iterator[tuple[str, np.ndarray]]:
    """(causal-LM name, float32 array) of each checkpoint tensor that is written: a VLM's text path only (`vlm`), the
    output matrix once when tied, not `LEFT_OUT`."""
    tied = bool(cfg.get("tie_word_embeddings", False))
    for original, tensor in weights:
        key = text_name(original, vlm)
        if key is None or (tied and key == "lm_head.weight") or key.startswith(LEFT_OUT):
            continue
        if key.endswith(".layer_scalar"):  # Gemma 4's per-layer output scale, a bare buffer name
            key += ".weight"
        yield key, tensor.detach().to("cpu").float().numpy() if hasattr(tensor, "detach") else np.asarray(
            tensor, np.float32)


def gguf_tensors(weights: Iterable[tuple[str, Any]], cfg: dict[str, Any],
                 vlm: bool = False) -> Iterable[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) for each (checkpoint name, tensor): names from gguf's table, q/k reordered for
    llama, Gemma's norms +1 (`gguf_gemma.NORM_SHIFT`), Qwen3.5's delta-net and experts in llama.cpp's layout
    (`gguf_qwen35.qwen35_arrays`), a VLM's text path only (`vlm`)."""
    import gguf

    arch = getattr(gguf.MODEL_ARCH, ARCHS[cfg["model_type"]])
    names = gguf.TensorNameMap(arch, int(cfg["num_hidden_layers"]))
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    shift = NORM_SHIFT.get(cfg["model_type"], 0.0)
    arrays = text_arrays(weights, cfg, vlm)
    for key, a in qwen35_arrays(arrays, cfg) if cfg["model_type"] in QWEN35_TYPES else arrays:
        new = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ValueError(f"GGUF export: tensor {key} has no name in gguf's {cfg['model_type']} table")
        if cfg["model_type"] in PERMUTED and key.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias",
                                                           "k_proj.bias")):
            a = rope_interleave(a, heads if ".q_proj." in key else kv_heads)
        if shift and key.endswith("norm.weight"):
            a = a + np.float32(shift)
        yield new, a


FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
              "q5_1": "MOSTLY_Q5_1", "q5_0": "MOSTLY_Q5_0", "q4_1": "MOSTLY_Q4_1", "q4_0": "MOSTLY_Q4_0"}
"""`general.file_type` (gguf.LlamaFileType member) of each type."""


def write_gguf(weights: Iterable[tuple[str, Any]], model_dir: Path, out: Path, dtype: str,
               rope_scaling: dict[str, Any] | None = None) -> Path:
    """Write `weights` (checkpoint names -> tensors) with `model_dir`'s config.json (train `rope_scaling` merged
    over its RoPE parameters) and tokenizer as the GGUF file `out` of type `dtype` (one of `TYPES`), through a
    temporary name and a rename."""
    import gguf

    if dtype not in TYPES:
        raise ConfigError(f"GGUF type '{dtype}' is not one tidal writes; valid: {', '.join(TYPES)}")
    full = json.loads((model_dir / "config.json").read_text())
    check_gguf_export(full, model_dir, str(model_dir / "config.json"), rope_scaling)
    cfg = text_config(full)
    rope = rope_params(cfg, rope_scaling) if cfg["model_type"] not in GEMMA_TYPES else {}
    arch = getattr(gguf.MODEL_ARCH, ARCHS[cfg["model_type"]])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        w = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[arch])
        add_hparams(w, cfg, out.stem, rope, rope_scaling)
        w.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[dtype]))
        from tidal.trainer.publish.gguf_vocab import add_tokenizer

        add_tokenizer(w, model_dir, int(cfg["vocab_size"]))
        freqs = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        if str(rope.get("rope_type") or "").lower() == "llama3":
            w.add_tensor(freqs, llama3_rope_factors(rope, head_dim(cfg)))
        if cfg["model_type"] == "gemma4_text":
            w.add_tensor(freqs, np.asarray(proportional_freqs(cfg, rope_scaling), np.float32))
        for name, array in gguf_tensors(weights, cfg, cfg is not full):
            data, qtype = encode(name, array, dtype)
            w.add_tensor(name, data, raw_dtype=qtype if qtype not in (gguf.GGMLQuantizationType.F32,
                                                                       gguf.GGMLQuantizationType.F16) else None)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
