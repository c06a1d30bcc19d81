"""GGUF out, Qwen3.5 text models, dense and MoE (`qwen3_5_text`, `qwen3_5_moe_text`, and the text path of `qwen3_5` /
`qwen3_5_moe` vision-language checkpoints): the `{arch}.*` hyperparameters llama.cpp reads, the tensor conventions of
its `qwen35` / `qwen35moe` models, and what of a config it would not read (`tidal.trainer.publish.gguf_out` writes the
rest and calls these).

The reference is the llama.cpp that llama-cpp-python 0.3.36 vendors (`src/models/qwen35.cpp`, the QWEN35 loading in
`src/llama-model.cpp`, and what its `conversion/qwen.py` writes for `Qwen3_5ForCausalLM`). Written:
- hyperparameters: the gated delta-net's `ssm.conv_kernel` (linear_conv_kernel_dim), `ssm.state_size`
  (linear_key_head_dim), `ssm.group_count` (linear_num_key_heads), `ssm.time_step_rank` (linear_num_value_heads),
  `ssm.inner_size` (value head dim x value heads); which layers are recurrent (`attention.recurrent_layers`, one flag
  per layer from `layer_types`, so no default period is assumed; `full_attention_interval` beside it); the rotary
  dimension count of the full-attention layers (head_dim x partial_rotary_factor, transformers' default 0.25) and
  the MRoPE `rope.dimension_sections` (the config's `mrope_section`, else transformers' default [11, 11, 10]; padded
  to 4). For text, all three MRoPE positions are the token's position in both transformers and llama.cpp, so the
  sections only decide which rotary pair reads which (equal) position; llama.cpp gives a pair outside every section
  position 0 (`e`), which is refused (`qwen35_problems`), as is a section sum above head_dim (a ggml assertion);
- tensors (`qwen35_tensor`): `A_log` as `ssm_a` = -exp(A_log) (llama.cpp multiplies by it); `dt_bias` as
  `ssm_dt.bias`; the depthwise conv1d weight (C, 1, K) squeezed to (C, K); every RMS norm weight + 1 (transformers'
  Qwen3.5 norms compute x * (1 + w), llama.cpp's x * w) except the delta-net's gated norm (`linear_attn.norm`, x * w in
  both); the full-attention `q_proj` as it is (per head: query rows then gate rows, llama.cpp's view of the fused Q);
- the V-head order: with fewer key heads than value heads transformers repeats each key head for consecutive value
  heads (grouped: value head j reads key head j // r), llama.cpp's broadcast tiles them (j reads j % n_k); so the
  value-head axis of in_proj_qkv's V rows, in_proj_z, in_proj_a, in_proj_b, A_log, dt_bias, the conv1d's V channels
  and out_proj's columns is permuted from grouped to tiled (`reorder_v_heads`), as llama.cpp's converter does.
- MoE (`qwen35moe`): expert count, experts used, the routed and the shared experts' widths; the router
  (`mlp.gate`) as `ffn_gate_inp`, the experts as 3-d tensors (E, rows, cols) `ffn_gate_exps`, `ffn_up_exps`,
  `ffn_down_exps`, as llama.cpp's converter writes them: transformers 5's in-memory fused `gate_up_proj` split in its
  gate and up halves, a checkpoint's per-expert `experts.{e}.{gate,up,down}_proj` (what transformers 5 saves)
  stacked once a layer's are all read; the shared expert and its sigmoid gate (`ffn_*_shexp`, `ffn_gate_inp_shexp`).
  llama.cpp routes by softmax over all experts, top-k, renormalised: transformers' Qwen3.5-MoE router does the same.
Not written: the multi-token-prediction head of Qwen3.5 checkpoints (`mtp.*` tensors, `mtp_num_hidden_layers`):
transformers does not load it, so tidal neither trains nor has it; llama.cpp runs the model without it (it is only a
speculative-decoding draft) and the file says none (`nextn_predict_layers` absent).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

QWEN35_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
"""HF `model_type`s written by this module (a `qwen3_5` / `qwen3_5_moe` vision-language checkpoint through its
text_config)."""
MOE = "qwen3_5_moe_text"
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
"""Config keys of a Qwen3.5-MoE that llama.cpp's qwen35moe reads (`add_qwen35_hparams`)."""
DEFAULT_MROPE = [11, 11, 10]
"""transformers' Qwen3.5 `mrope_section` when the config has none (and llama.cpp's converter's)."""
DEFAULT_PARTIAL = 0.25
"""transformers' Qwen3.5 `partial_rotary_factor` when the config has none."""
KINDS = ("linear_attention", "full_attention")


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """Per layer `linear_attention` or `full_attention`: the config's `layer_types`, else every
    `full_attention_interval`-th layer (default 4) full, as transformers derives them."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    every = int(cfg.get("full_attention_interval") or 4)
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention"
            for i in range(int(cfg["num_hidden_layers"]))]


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    return rope


def rope_theta(cfg: dict[str, Any]) -> float:
    return float(_rope(cfg).get("rope_theta") or cfg.get("rope_theta") or 10000.0)


def head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))


def rotary_dims(cfg: dict[str, Any]) -> int:
    """Rotated dimensions of a full-attention head (transformers: int(head_dim x partial_rotary_factor))."""
    rope = _rope(cfg)
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", DEFAULT_PARTIAL))
    return int(head_dim(cfg) * float(factor if factor is not None else DEFAULT_PARTIAL))


def mrope_sections(cfg: dict[str, Any]) -> list[int]:
    """The 4 `rope.dimension_sections` llama.cpp reads: the config's `mrope_section` (or the default), padded."""
    sections = [int(x) for x in (_rope(cfg).get("mrope_section") or cfg.get("mrope_section") or DEFAULT_MROPE)]
    return (sections + [0, 0, 0, 0])[:4]


def unpositioned_pairs(sections: list[int], pairs: int) -> list[int]:
    """Rotary pairs (of `pairs`) that llama.cpp's interleaved MRoPE would turn by position 0 instead of the token's
    (ggml's `ggml_mrope_cache_init`, is_imrope: pair i -> sector i % sum(sections); sector s reads t, h or w when
    s % 3 is 0, 1, 2 and s < 3 x that section, else the fourth position, 0 for text)."""
    total = sum(sections)
    out = []
    for i in range(pairs):
        s = i % total
        if not s < 3 * sections[s % 3]:
            out.append(i)
    return out


def qwen35_problems(cfg: dict[str, Any], overlay: dict[str, Any] | None = None) -> list[str]:
    """What of a Qwen3.5 text config llama.cpp's qwen35 would not read (each names its config key); [] when all is
    written."""
    out = []
    if cfg.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act '{cfg['hidden_act']}' (llama.cpp's qwen35 uses silu in the MLP and the convolution)")
    if cfg.get("attention_bias"):
        out.append("attention_bias true (llama.cpp's qwen35 reads no attention biases)")
    if overlay:
        out.append(f"train rope_scaling {overlay} (llama.cpp's qwen35 runs default RoPE)")
    kind = str(_rope(cfg).get("rope_type") or "default")
    if kind != "default":
        out.append(f"rope_parameters.rope_type '{kind}' (written for qwen35: default)")
    kinds = set(layer_types(cfg))
    if not kinds <= set(KINDS):
        out.append(f"layer_types {sorted(kinds)} (written: {', '.join(KINDS)})")
    if len(layer_types(cfg)) != int(cfg["num_hidden_layers"]):
        out.append(f"layer_types has {len(layer_types(cfg))} entries for num_hidden_layers {cfg['num_hidden_layers']}")
    kdim, vdim = int(cfg.get("linear_key_head_dim", 128)), int(cfg.get("linear_value_head_dim", 128))
    if kdim != vdim:
        out.append(f"linear_key_head_dim {kdim} != linear_value_head_dim {vdim} (llama.cpp's qwen35 sizes both "
                   "from ssm.state_size)")
    nk, nv = int(cfg.get("linear_num_key_heads", 16)), int(cfg.get("linear_num_value_heads", 32))
    if nv % nk:
        out.append(f"linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}")
    if cfg.get("model_type") == MOE:
        out += [f"{k} missing (llama.cpp's qwen35moe needs it)" for k in MOE_KEYS if not cfg.get(k)]
        if cfg.get("mlp_only_layers"):
            out.append(f"mlp_only_layers {cfg['mlp_only_layers']} (llama.cpp's qwen35moe has experts in every layer)")
    sections, pairs = mrope_sections(cfg), rotary_dims(cfg) // 2
    if sum(sections) <= 0 or sum(sections) > head_dim(cfg):
        out.append(f"rope_parameters.mrope_section {sections[:3]} (llama.cpp needs 0 < sum <= head_dim "
                   f"{head_dim(cfg)})")
    elif unpositioned_pairs(sections, pairs):
        out.append(f"rope_parameters.mrope_section {sections} (llama.cpp would turn rotary pairs "
                   f"{unpositioned_pairs(sections, pairs)} of {pairs} by position 0: no section covers them)")
    return out


def add_qwen35_hparams(w: Any, cfg: dict[str, Any]) -> None:
    """The qwen35-specific keys (module docstring); the common ones are written by gguf_out."""
    nv, vdim = int(cfg.get("linear_num_value_heads", 32)), int(cfg.get("linear_value_head_dim", 128))
    w.add_rope_freq_base(rope_theta(cfg))
    w.add_rope_dimension_count(rotary_dims(cfg))
    w.add_rope_dimension_sections(mrope_sections(cfg))
    w.add_ssm_conv_kernel(int(cfg.get("linear_conv_kernel_dim", 4)))
    w.add_ssm_state_size(int(cfg.get("linear_key_head_dim", 128)))
    w.add_ssm_group_count(int(cfg.get("linear_num_key_heads", 16)))
    w.add_ssm_time_step_rank(nv)
    w.add_ssm_inner_size(vdim * nv)
    w.add_array(f"{w.arch}.attention.recurrent_layers", [t == "linear_attention" for t in layer_types(cfg)])
    w.add_full_attention_interval(int(cfg.get("full_attention_interval") or 4))
    if cfg.get("model_type") == MOE:
        w.add_expert_count(int(cfg["num_experts"]))
        w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
        w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
        w.add_expert_shared_feed_forward_length(int(cfg["shared_expert_intermediate_size"]))


def reorder_v_heads(a: np.ndarray, axis: int, n_k: int, per_k: int, dim: int) -> np.ndarray:
    """Value heads along `axis` (n_k x per_k heads of `dim` each) from transformers' grouped order (head g * per_k + j
    belongs to key head g) to llama.cpp's tiled order (position j * n_k + g)."""
    a = np.moveaxis(a, axis, 0)
    rest = a.shape[1:]
    a = a.reshape(n_k, per_k, dim, *rest).swapaxes(0, 1).reshape(n_k * per_k * dim, *rest)
    return np.moveaxis(a, 0, axis)


def qwen35_tensor(key: str, a: np.ndarray, cfg: dict[str, Any]) -> tuple[str, np.ndarray]:
    """(checkpoint name as gguf's table knows it, array in llama.cpp's layout) for Qwen3.5 tensor `key` (float32)."""
    n_k, n_v = int(cfg.get("linear_num_key_heads", 16)), int(cfg.get("linear_num_value_heads", 32))
    kdim, vdim = int(cfg.get("linear_key_head_dim", 128)), int(cfg.get("linear_value_head_dim", 128))
    per_k, linear = n_v // n_k, ".linear_attn." in key
    if linear and key.endswith(".conv1d.weight"):
        a = a.reshape(a.shape[0], a.shape[-1])  # (C, 1, K) -> (C, K)
    if linear and per_k > 1:
        qk = 2 * n_k * kdim
        if key.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
            a = np.concatenate([a[:qk], reorder_v_heads(a[qk:], 0, n_k, per_k, vdim)])
        elif key.endswith(".in_proj_z.weight"):
            a = reorder_v_heads(a, 0, n_k, per_k, vdim)
        elif key.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
            a = reorder_v_heads(a, 0, n_k, per_k, 1)
        elif key.endswith(".out_proj.weight"):
            a = reorder_v_heads(a, 1, n_k, per_k, vdim)
    if key.endswith(".A_log"):
        a = -np.exp(a.astype(np.float64)).astype(np.float32)
    elif key.endswith(".dt_bias"):
        key = key[: -len(".dt_bias")] + ".dt_proj.bias"
    elif key.endswith("norm.weight") and not key.endswith(".linear_attn.norm.weight"):
        a = a + np.float32(1.0)
    return key, a


EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
"""A per-expert tensor of a checkpoint (transformers 5 saves MoE experts so): prefix, expert, projection."""


def qwen35_arrays(stream: Iterable[tuple[str, np.ndarray]], cfg: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """`qwen35_tensor` over (checkpoint name, float32 array) pairs; a MoE's experts as one (E, rows, cols) tensor per
    layer and projection (`...mlp.experts.gate_proj.weight`, as gguf's table names them, llama.cpp's `ffn_gate_exps`
    etc.): transformers 5's fused `gate_up_proj` split in its gate and up halves, a checkpoint's per-expert tensors
    stacked, so both give the same file; ValueError if a layer's experts are incomplete at the end."""
    n = int(cfg.get("num_experts") or 0)
    pending: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for key, a in stream:
        if key.endswith(".mlp.experts.gate_up_proj"):  # transformers 5's fused (E, 2F, H): gate rows, then up rows
            half = a.shape[1] // 2
            yield key[: -len("gate_up_proj")] + "gate_proj.weight", a[:, :half]
            yield key[: -len("gate_up_proj")] + "up_proj.weight", a[:, half:]
            continue
        if key.endswith(".mlp.experts.down_proj"):  # (E, H, F)
            yield key + ".weight", a
            continue
        m = EXPERT.match(key)
        if m is None:
            yield qwen35_tensor(key, a, cfg)
            continue
        group = pending.setdefault((m[1], m[3]), {})
        group[int(m[2])] = a
        if len(group) == n:
            del pending[(m[1], m[3])]
            yield f"{m[1]}.{m[3]}.weight", np.stack([group[e] for e in range(n)])
    if pending:
        raise ValueError(f"GGUF export: experts missing of {n}: " + ", ".join(
            f"{prefix}.*.{proj} has {sorted(got)}" for (prefix, proj), got in pending.items()))
