"""Qwen3.5 on vLLM-CPU without torchvision: the plugin's two patches (`tidal.inference.backends.vllm.vl_imports`,
`gdn_fp32`) and the up-front rule (`support.check_vision_imports`).

- vLLM 0.32's `qwen3_5.py` fails to import here without the plugin (no torchvision), and imports with it;
- the float32 gated-delta-net path (`gdn_fp32.torch_core`), fed a step of prefills and decodes the way vLLM's
  metadata lays them out, carries each sequence's conv window and recurrent state across steps exactly (float64:
  equal to the whole sequence in one step) and equals transformers' torch path (`torch_chunk_gated_delta_rule`,
  the trainer's; it computes in float32) on random inputs;
- the up-front check passes Qwen3.5 where the stand-in works and refuses it where torchvision is installed but
  broken, naming the install line.
The served end to end (tiny Qwen3.5, fp32, LoRA, reloads, push, grpo) is `tests/integration/test_arch_matrix.py`.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tidal.config.load import ConfigError
from tidal.inference.backends.vllm import gdn_fp32, support, vl_imports

IMPORT = """
import importlib, sys
for mod in ("qwen3_5", "gemma3_mm", "gemma4_mm"):
    try:
        importlib.import_module("vllm.model_executor.models." + mod)
        print("without:", mod, "ok")
    except ModuleNotFoundError as exc:
        print("without:", mod, exc.name)
    for name in [m for m in sys.modules if m.startswith(("vllm.model_executor.models.", "transformers.models."))
                 and any(k in m for k in ("qwen", "gemma"))]:
        del sys.modules[name]
from tidal.inference.backends.vllm import plugin
plugin.register()
import vllm.model_executor.models.qwen3_5 as m
import vllm.model_executor.models.gemma3_mm as g3
import vllm.model_executor.models.gemma4_mm as g4
print("with:", m.Qwen3_5ForCausalLM.__name__, g3.Gemma3ForConditionalGeneration.__name__,
      g4.Gemma4ForConditionalGeneration.__name__, plugin.installed()["vl_imports"])
"""


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed here")
def test_qwen3_5_and_gemma_vlm_model_code_imports_only_with_the_plugin():
    pytest.importorskip("vllm")
    done = subprocess.run([sys.executable, "-c", IMPORT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "without: qwen3_5 torchvision" in done.stdout, done.stdout
    assert "without: gemma3_mm torchvision" in done.stdout, done.stdout
    assert "without: gemma4_mm ok" not in done.stdout, done.stdout  # (its import error names a transformers class)
    assert ("with: Qwen3_5ForCausalLM Gemma3ForConditionalGeneration Gemma4ForConditionalGeneration True"
            in done.stdout), done.stdout


def reference(x, weight, a, b, A_log, dt_bias, hk, hv):
    """transformers' Qwen3.5 gated-delta-net core (its torch path) on one whole sequence x: (L, dim)."""
    import torch.nn.functional as F
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    n, dim = x.shape
    y = F.silu(F.conv1d(x.t()[None], weight, padding=weight.shape[-1] - 1, groups=dim)[..., :n])[0].t()
    kd = (dim - hv * 32) // 2
    q, k, v = torch.split(y, [kd, kd, hv * 32], dim=-1)
    q = q.reshape(1, n, hk, -1).repeat_interleave(hv // hk, dim=2)
    k = k.reshape(1, n, hk, -1).repeat_interleave(hv // hk, dim=2)
    v = v.reshape(1, n, hv, -1)
    g = -A_log.exp() * F.softplus(a + dt_bias)
    out, _ = torch_chunk_gated_delta_rule(q, k, v, g=g[None], beta=b.sigmoid()[None], use_qk_l2norm_in_kernel=True)
    return out[0]  # (L, hv, v_dim)


def test_float32_gdn_path_equals_transformers_across_steps():
    torch.manual_seed(0)
    f64 = torch.float64
    hk, hv, kdim, vdim, width = 2, 4, 32, 32, 4
    dim = 2 * hk * kdim + hv * vdim
    layer = SimpleNamespace(tp_size=1, key_dim=hk * kdim, value_dim=hv * vdim, num_k_heads=hk, num_v_heads=hv,
                            A_log=torch.randn(hv, dtype=f64), dt_bias=torch.randn(hv, dtype=f64),
                            conv1d=SimpleNamespace(weight=torch.randn(dim, 1, width, dtype=f64) * 0.5, bias=None),
                            kv_cache=[torch.full((5, dim, width - 1), 9.0, dtype=f64),  # stale slots: must be reset
                                      torch.full((5, hv, vdim, kdim), 9.0, dtype=f64)])
    lengths = {1: 11, 3: 7}  # slot -> sequence length
    xs = {s: torch.randn(n, dim, dtype=f64) for s, n in lengths.items()}
    ab = {s: (torch.randn(n, hv, dtype=f64), torch.randn(n, hv, dtype=f64)) for s, n in lengths.items()}
    got = {s: [] for s in lengths}

    def step(decodes: list[tuple[int, int]], prefills: list[tuple[int, int, int, bool]]) -> None:
        """decodes: (slot, token index); prefills: (slot, start, end, has a prior state)."""
        spans = [(s, t, t + 1) for s, t in decodes] + [(s, lo, hi) for s, lo, hi, _ in prefills]
        starts = [0]
        for _, lo, hi in spans:
            starts.append(starts[-1] + hi - lo)
        meta = SimpleNamespace(spec_sequence_masks=None, num_accepted_tokens=None,
                               non_spec_query_start_loc=torch.tensor(starts),
                               non_spec_state_indices_tensor=torch.tensor([s for s, _, _ in spans]),
                               num_decodes=len(decodes), num_prefills=len(prefills),
                               has_initial_state=torch.tensor([True] * len(decodes) + [p[3] for p in prefills]))
        x = torch.cat([xs[s][lo:hi] for s, lo, hi in spans])
        a = torch.cat([ab[s][0][lo:hi] for s, lo, hi in spans])
        b = torch.cat([ab[s][1][lo:hi] for s, lo, hi in spans])
        out = torch.zeros(len(x), hv, vdim, dtype=f64)
        gdn_fp32.torch_core(layer, meta, x, b, a, out, conv_state_dim_first=True)
        for (s, _, _), o0, o1 in zip(spans, starts, starts[1:], strict=False):
            got[s].append(out[o0:o1])

    step([], [(1, 0, 5, False), (3, 0, 4, False)])  # two prompts, chunked
    step([], [(1, 5, 9, True)])  # the rest of one prompt
    step([(3, 4), (1, 9)], [])  # decodes
    step([(3, 5), (1, 10)], [])
    step([(3, 6)], [])
    stepwise = {s: torch.cat(got.pop(s)) for s in lengths}
    got.update({s: [] for s in lengths})
    step([], [(3, 0, 7, False), (1, 0, 11, False)])  # each sequence whole, in one step
    for s in lengths:  # float64: the state and conv window carried across steps exactly
        assert torch.allclose(stepwise[s], torch.cat(got[s]), atol=1e-12, rtol=0), f"slot {s}"
        # transformers' chunked algorithm (which computes in float32 whatever the model's dtype): the same numbers
        want = reference(xs[s], layer.conv1d.weight, ab[s][0], ab[s][1], layer.A_log, layer.dt_bias, hk, hv)
        gap = float((stepwise[s] - want).abs().max())
        assert gap < 1e-6 * float(want.abs().max()), f"slot {s}: {gap}"


def test_the_gdn_path_is_installed_on_cpu_and_keeps_the_op_signature():
    pytest.importorskip("vllm")
    import inspect

    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    original = gdn_attention.cpu_gdn_attention_core
    assert gdn_fp32.install() and gdn_fp32.install()  # idempotent
    wrapped = gdn_attention.cpu_gdn_attention_core
    assert getattr(wrapped, gdn_fp32.MARK)
    assert list(inspect.signature(wrapped).parameters) == list(inspect.signature(original).parameters)


def test_the_up_front_rule_for_qwen3_5(monkeypatch):
    monkeypatch.setattr(vl_imports, "needed", lambda: True)  # torchvision absent, the twin present: served
    for arch in support.TEXT_PATH_ARCHS:
        support.check_vision_imports(arch, "m")
    monkeypatch.setattr(vl_imports, "needed", lambda: False)  # installed but broken: refused with the install line
    monkeypatch.setattr(support, "torchvision_problem", lambda: "`import torchvision` fails: RuntimeError: operator "
                                                                "torchvision::nms does not exist")
    with pytest.raises(ConfigError, match=r"'m' is a Qwen3_5ForCausalLM: .* pip install torchvision"):
        support.check_vision_imports("Qwen3_5ForCausalLM", "m")
    monkeypatch.setattr(vl_imports, "needed", lambda: True)
    with pytest.raises(ConfigError, match="Qwen3VLForConditionalGeneration"):  # the image models: as before
        support.check_vision_imports("Qwen3VLForConditionalGeneration", "m")
