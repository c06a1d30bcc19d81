"""GGUF out, the Gemma family (Gemma, Gemma 2, Gemma 3 and Gemma 4 text, and the text path of Gemma 3 / 4
vision-language checkpoints): the `{arch}.*` hyperparameters llama.cpp's `gemma`, `gemma2`, `gemma3` and `gemma4`
models read, and what of a Gemma config they would not read (`tidal.trainer.publish.gguf_out` writes the tensors and
calls these).

What llama.cpp (0.3.36's vendored source, `src/models/gemma*.cpp`) does on its own, and so what must hold of the
config rather than be written:
- the embedding is scaled by sqrt(hidden_size) (transformers' `embed_scale`, the same number);
- RMS norms multiply by the stored weight; transformers' Gemma 1-3 norms by `1 + weight`, so their `*norm.weight`
  are written +1 (`NORM_SHIFT`, as llama.cpp's convert_hf_to_gguf.py does for gemma/gemma2/gemma3; Gemma 4's norms
  multiply by the weight in both);
- queries are scaled by 1/sqrt(head_dim), or by 1/sqrt(hidden_size / heads) for the 27B shapes (46 layers in
  Gemma 2, 62 in Gemma 3); transformers by `query_pre_attn_scalar ** -0.5`: a config where the two differ is refused;
- the MLP is GELU with the tanh approximation (`gelu_pytorch_tanh`), other activations are refused;
- gemma and gemma2 always use the embedding as output layer (untied checkpoints are refused); gemma2 always
  soft-caps attention and final logits (a config without either cap is refused).
Written: the sliding window and, per layer, whether it slides (`attention.sliding_window_pattern` as a list from
`layer_types`, so no default period is assumed); RoPE bases of global and sliding layers (`rope.freq_base`,
`rope.freq_base_swa`) and a linear scaling factor of the global layers (Gemma 3 4B+); final and attention logit
soft-capping where the config has them. Gemma 4 (dense, without per-layer input embeddings: `GEMMA4_UNWRITTEN`):
the global layers' head size and KV heads beside the sliding layers' (`key_length` / `key_length_swa`, a per-layer
`head_count_kv`), its proportional RoPE on the global layers as the `rope_freqs` tensor (`proportional_freqs`), the
per-layer output scale (`layer_scalar`), queries scaled by 1 (q and k are normalised), V normalised without weight
(llama.cpp does that itself), final soft-capping written even when off (llama.cpp's default is 30).
"""

from __future__ import annotations

import math
from typing import Any

from tidal.models.rope import merge_rope, model_rope_parameters

GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text", "gemma4_text")
"""HF `model_type`s written by this module (a Gemma 3 / 4 vision-language checkpoint through its text_config)."""
GEMMA4_UNWRITTEN = {"hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "enable_moe_block": False,
                    "use_double_wide_mlp": False, "attention_k_eq_v": False}
"""Gemma 4 config keys whose other values (per-layer input embeddings of E2B/E4B, KV shared across layers, the MoE
block of 26B-A4B, double-wide MLPs, values from keys) tidal does not write: refused, naming the key."""
NORM_SHIFT = {"gemma": 1.0, "gemma2": 1.0, "gemma3_text": 1.0}
"""Added to every `*norm.weight` (transformers' Gemma RMS norms compute `x * (1 + w)`, llama.cpp's `x * w`)."""
TIED_ONLY = {"gemma", "gemma2"}
"""llama.cpp's gemma and gemma2 read no output matrix: the embedding is the output layer."""
BIG_LAYERS = {"gemma2": 46, "gemma3_text": 62}
"""Layer count at which llama.cpp scales queries by 1/sqrt(hidden/heads) instead of 1/sqrt(head_dim) (the 27Bs)."""


def head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))


def layer_override(cfg: dict[str, Any], key: str) -> Any:
    """Gemma 4: the global layers' value of `key` (`per_layer_config` of a full-attention layer), else None."""
    types = layer_types(cfg)
    for idx, values in (cfg.get("per_layer_config") or {}).items():
        if int(idx) < len(types) and types[int(idx)] == "full_attention" and key in values:
            return values[key]
    return None


def full_head_dim(cfg: dict[str, Any]) -> int:
    """Head size of the global layers (Gemma 4's may differ from `head_dim`, the sliding layers')."""
    if cfg.get("model_type") == "gemma4_text":
        return int(layer_override(cfg, "head_dim") or cfg.get("global_head_dim") or head_dim(cfg))
    return head_dim(cfg)


def kv_heads(cfg: dict[str, Any]) -> int | list[int]:
    """KV heads: one number, or one per layer where Gemma 4's global layers have their own."""
    swa = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    full = layer_override(cfg, "num_key_value_heads") if cfg.get("model_type") == "gemma4_text" else None
    if full is None or int(full) == swa:
        return swa
    return [swa if t == "sliding_attention" else int(full) for t in layer_types(cfg)]


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """Per layer `sliding_attention` or `full_attention` (the config's `layer_types`, else the family's default)."""
    n = int(cfg["num_hidden_layers"])
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    mt = cfg.get("model_type")
    if mt == "gemma":
        return ["full_attention"] * n
    period = 2 if mt == "gemma2" else int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n)]


def gemma_rope(cfg: dict[str, Any], overlay: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global layers' RoPE parameters, sliding layers'): per layer type in transformers 5's Gemma 3 configs, one
    dict for both otherwise (Gemma 3 configs of transformers 4 give the local base as `rope_local_base_freq`);
    train `rope_scaling` (`overlay`) merged over them as the trainer merges it."""
    rope = model_rope_parameters(cfg)
    if overlay:
        rope = merge_rope(rope, overlay, "train rope_scaling")
    if rope and all(isinstance(v, dict) for v in rope.values()):
        full = dict(rope.get("full_attention") or {})
        return full, dict(rope.get("sliding_attention") or full)
    sliding = dict(rope)
    if cfg.get("rope_local_base_freq") is not None:
        sliding = {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}
    return dict(rope), sliding


def expected_query_scale(cfg: dict[str, Any]) -> float:
    """The query scale llama.cpp applies to this config (module docstring)."""
    mt = cfg.get("model_type")
    if mt == "gemma4_text":
        return 1.0  # Gemma 4 normalises q and k and scales by 1, in both
    if mt in BIG_LAYERS and int(cfg["num_hidden_layers"]) == BIG_LAYERS[mt]:
        return 1 / math.sqrt(int(cfg["hidden_size"]) / int(cfg["num_attention_heads"]))
    return 1 / math.sqrt(head_dim(cfg))


def gemma_problems(cfg: dict[str, Any], overlay: dict[str, Any] | None = None) -> list[str]:
    """What of a Gemma config llama.cpp would not read (each names its config key); [] when all is written."""
    mt, out = cfg.get("model_type"), []
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        out.append(f"hidden_activation '{act}' (llama.cpp's {mt} uses GELU with the tanh approximation)")
    if mt in TIED_ONLY and not cfg.get("tie_word_embeddings", True):
        out.append(f"tie_word_embeddings false (llama.cpp's {mt} uses the embedding as output layer)")
    scalar, scale = cfg.get("query_pre_attn_scalar"), expected_query_scale(cfg)
    if mt == "gemma4_text":
        out += [f"{k} {cfg[k]} (tidal writes Gemma 4 with {k} {v} only)" for k, v in GEMMA4_UNWRITTEN.items()
                if cfg.get(k) not in (None, v)]
    checked = mt not in ("gemma", "gemma4_text") and scalar is not None
    if checked and not math.isclose(float(scalar or 1) ** -0.5, scale, rel_tol=1e-6):
        out.append(f"query_pre_attn_scalar {scalar} (llama.cpp's {mt} scales queries by {scale:.6g}, i.e. "
                   f"query_pre_attn_scalar {1 / scale ** 2:g})")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if mt == "gemma2" and cfg.get(key) is None:
            out.append(f"{key} null (llama.cpp's gemma2 always soft-caps there)")
    if mt in ("gemma3_text", "gemma4_text") and cfg.get("attn_logit_softcapping") is not None:
        out.append(f"attn_logit_softcapping {cfg['attn_logit_softcapping']} (llama.cpp's {mt} does not soft-cap "
                   "attention logits)")
    if cfg.get("use_bidirectional_attention"):
        out.append("use_bidirectional_attention true (llama.cpp runs the text model causally)")
    kinds = set(layer_types(cfg))
    if not kinds <= {"sliding_attention", "full_attention"}:
        out.append(f"layer_types {sorted(kinds)} (written: sliding_attention, full_attention)")
    full, sliding = gemma_rope(cfg, overlay)
    full_kinds = ("proportional",) if mt == "gemma4_text" else ("default", "linear")
    for name, rope, allowed in (("full_attention", full, full_kinds), ("sliding_attention", sliding, ("default",))):
        kind = str(rope.get("rope_type") or "default")
        if kind not in allowed:
            out.append(f"rope_parameters.{name}.rope_type '{kind}' (llama.cpp's {mt} reads {' or '.join(allowed)} "
                       "there)")
        elif kind == "linear" and not rope.get("factor"):
            out.append(f"rope_parameters.{name}.factor (rope_type linear needs it)")
    if mt in ("gemma", "gemma2") and float(full.get("rope_theta", 1e4)) != float(sliding.get("rope_theta", 1e4)):
        out.append(f"rope_parameters: different bases per layer type on {mt}")
    if float(cfg.get("partial_rotary_factor") or 1.0) != 1.0 or (
            mt != "gemma4_text" and float(full.get("partial_rotary_factor") or 1.0) != 1.0):
        out.append("partial_rotary_factor (llama.cpp rotates the whole head here)")
    return out


def proportional_freqs(cfg: dict[str, Any], overlay: dict[str, Any] | None) -> list[float]:
    """Gemma 4's global layers (`proportional` RoPE): the rotated part of the head turns at the full head's
    frequencies, the rest not at all; as llama.cpp's `rope_freqs` divisors (1, then 1e30 for the unrotated pairs)."""
    full, _ = gemma_rope(cfg, overlay)
    dim = full_head_dim(cfg)
    rotated = int(float(full.get("partial_rotary_factor") or 1.0) * dim // 2)
    return [1.0] * rotated + [1e30] * (dim // 2 - rotated)


def add_gemma_hparams(w: Any, cfg: dict[str, Any], overlay: dict[str, Any] | None) -> None:
    """The Gemma-specific `{arch}.*` keys (module docstring); the common ones are written by gguf_out."""
    import gguf

    mt = cfg["model_type"]
    full, sliding = gemma_rope(cfg, overlay)
    w.add_rope_freq_base(float(full.get("rope_theta", 10000.0)))
    if str(full.get("rope_type") or "default") in ("linear", "proportional") and full.get("factor", 1.0) != 1.0:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(full["factor"]))
    types = layer_types(cfg)
    if mt == "gemma4_text":  # llama.cpp requires these keys for gemma4
        w.add_key_length_swa(head_dim(cfg))
        w.add_value_length_swa(head_dim(cfg))
        w.add_rope_dimension_count_swa(int(head_dim(cfg) * float(sliding.get("partial_rotary_factor") or 1.0)))
        w.add_embedding_length_per_layer_input(0)
        w.add_shared_kv_layers(0)
        w.add_final_logit_softcapping(float(cfg.get("final_logit_softcapping") or 0.0))  # llama.cpp's default: 30
    if mt != "gemma":
        window = cfg.get("sliding_window")
        if window is not None and "sliding_attention" in types:
            w.add_sliding_window(int(window))
            w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
            w.add_rope_freq_base_swa(float(sliding.get("rope_theta", 10000.0)))
        elif mt == "gemma2":  # llama.cpp's gemma2 slides every other layer over 4096 unless told: a window no layer has
            w.add_sliding_window_pattern([False] * len(types))
    if cfg.get("final_logit_softcapping") is not None and mt != "gemma4_text":
        w.add_final_logit_softcapping(float(cfg["final_logit_softcapping"]))
    if mt == "gemma2":
        w.add_attn_logit_softcapping(float(cfg["attn_logit_softcapping"]))
