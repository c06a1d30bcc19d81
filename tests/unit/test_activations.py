"""Activation memory (`tidal.trainer.model.activations`; train `checkpoint_every`, `checkpoint_scope`,
`offload_activations`, `compile_layers`): every setting gives the gradients of no checkpointing (float64, LoRA,
packed rows), recomputes what it says (selective `elementwise` checkpointing: no matmul twice), and keeps fewer
saved activations in the order expected."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.archs import config_for
from tests.unit.test_packed_attention import packed_positions
from tidal.config.train import TrainConfig
from tidal.trainer.model.activations import apply_activation_policy, decoder_layers
from tidal.trainer.model.attention import register
from tidal.trainer.model.kernels import compile_layers
from tidal.trainer.model.load import add_lora, enable_gradient_checkpointing
from tidal.trainer.step.logprobs import forward_logprobs

SETTINGS = {
    "none": {},
    "every layer": {"gradient_checkpointing": True},
    "every 2nd layer": {"gradient_checkpointing": True, "checkpoint_every": 2},
    "mlp": {"gradient_checkpointing": True, "checkpoint_scope": "mlp"},
    "elementwise": {"gradient_checkpointing": True, "checkpoint_scope": "elementwise"},
    "every 2nd elementwise + offload": {"gradient_checkpointing": True, "checkpoint_scope": "elementwise",
                                        "checkpoint_every": 2, "offload_activations": True},
    "every 2nd mlp + offload": {"gradient_checkpointing": True, "checkpoint_scope": "mlp", "checkpoint_every": 2,
                                "offload_activations": True},
    "every 2nd layer + offload": {"gradient_checkpointing": True, "checkpoint_every": 2, "offload_activations": True},
    "offload": {"offload_activations": True},
}


def policy(name: str, keys: dict, layers: int = 4, dtype: torch.dtype = torch.float64, attn: str | None = None,
           ) -> torch.nn.Module:
    """A LoRA policy of architecture `name` built as `load_policy` builds it (random init, seed 0), with `keys`."""
    from transformers import AutoModelForCausalLM

    cfg = TrainConfig(model=name, lora_rank=4, **{"gradient_checkpointing": False, **keys})
    attn = attn or register()
    torch.manual_seed(0)
    conf = config_for(name)
    conf.num_hidden_layers = layers
    if getattr(conf, "layer_types", None):
        conf.layer_types = [conf.layer_types[0]] * layers
    model = AutoModelForCausalLM.from_config(conf, attn_implementation=attn, dtype=dtype)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    apply_activation_policy(model, cfg, torch.device("cpu"))
    model = add_lora(model, cfg)
    torch.manual_seed(1)
    for n, p in model.named_parameters():  # a trained-looking adapter: B != 0
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    return model.train()


def step(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, w: torch.Tensor,
         ) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Logprobs, LoRA gradients of sum(w x logprob), and the bytes of tensors saved for the backward that reach
    the outermost saved-tensor hook (what stays in device memory between forward and backward: checkpointed
    regions and offloaded layers keep theirs elsewhere)."""
    kept = [0]
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in seen:  # count each storage once (views of one tensor are one allocation)
            seen.add(key)
            kept[0] += t.untyped_storage().nbytes()
        return t

    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp = forward_logprobs(model, ids, pos, chunk_size=0)
    (lp * w).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, kept[0]


@pytest.mark.parametrize("arch", ["llama3", "qwen3", "phi3"])
def test_every_setting_gives_the_gradients_of_no_checkpointing(arch):
    rng = np.random.default_rng()
    ids = torch.from_numpy(rng.integers(3, 120, (2, 80)))
    pos = packed_positions(rng, 2, 80, pad=True)
    w = torch.from_numpy(rng.normal(size=ids.shape))
    results = {k: step(policy(arch, v), ids, pos, w) for k, v in SETTINGS.items()}
    lp0, g0, kept0 = results["none"]
    for k, (lp, g, _) in results.items():
        torch.testing.assert_close(lp, lp0, rtol=0, atol=1e-12, msg=k)
        assert g.keys() == g0.keys() and g0
        for n in g0:
            torch.testing.assert_close(g[n], g0[n], rtol=1e-9, atol=1e-12, msg=f"{k}: {n}")
    kept = {k: r[2] for k, r in results.items()}
    # what stays saved between forward and backward, in the expected order
    assert kept["every layer"] < kept["every 2nd layer"] < kept["none"]
    assert kept["mlp"] < kept["none"] and kept["every 2nd mlp + offload"] < kept["mlp"]
    assert kept["every 2nd layer + offload"] < kept["every 2nd layer"]
    assert kept["offload"] < 0.2 * kept["none"]  # the layers' activations went to save_on_cpu's storage


def test_the_policy_recomputes_what_it_says():
    """Forward calls per layer in one training step: a checkpointed layer's attention and MLP run twice (forward
    + recompute), `mlp` scope recomputes the MLP only, `checkpoint_every: 2` only layers 0 and 2."""
    rng = np.random.default_rng()
    ids = torch.from_numpy(rng.integers(3, 120, (1, 40)))
    pos = torch.arange(40)[None]
    w = torch.ones(1, 40, dtype=torch.float64)
    expect = {"every layer": ([2] * 4, [2] * 4), "every 2nd layer": ([2, 1, 2, 1], [2, 1, 2, 1]),
              "mlp": ([1] * 4, [2] * 4), "every 2nd mlp + offload": ([1] * 4, [2, 1, 2, 1]), "none": ([1] * 4,) * 2}
    for k, (attn, mlp) in expect.items():
        model = policy("llama3", SETTINGS[k])
        calls = {"attn": [0] * 4, "mlp": [0] * 4}

        def count(kind: str, i: int, calls: dict = calls):  # pre-hooks: a recompute stops after its last save
            return lambda *_: calls[kind].__setitem__(i, calls[kind][i] + 1)

        for i, layer in enumerate(decoder_layers(model)):
            layer.self_attn.register_forward_pre_hook(count("attn", i))
            layer.mlp.down_proj.register_forward_pre_hook(count("mlp", i))
        step(model, ids, pos, w)
        assert (calls["attn"], calls["mlp"]) == (attn, mlp), k


def test_elementwise_scope_keeps_the_matmuls_and_recomputes_the_rest(monkeypatch):
    """The selective policy's decisions in the forward of a checkpointed layer (torch's SAC then returns the kept
    outputs in the recompute instead of running those ops again): every matmul (base and LoRA) and the attention
    kernel kept, the elementwise ops (RMSNorm's, RoPE's, SwiGLU's, LoRA's scaling) recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    from tidal.trainer.model import activations

    decisions: list[tuple[str, object]] = []
    keep = activations._keep_matmuls

    def recording(ctx, op, *args, **kwargs):
        policy = keep(ctx, op, *args, **kwargs)
        decisions.append((str(getattr(op, "overloadpacket", op)), policy))
        return policy

    monkeypatch.setattr(activations, "_keep_matmuls", recording)
    rng = np.random.default_rng()
    ids = torch.from_numpy(rng.integers(3, 120, (1, 48)))
    model = policy("qwen3", SETTINGS["elementwise"], layers=2)
    forward_logprobs(model, ids, packed_positions(rng, 1, 48, pad=False), chunk_size=0).sum().backward()
    kept = {op for op, p in decisions if p == CheckpointPolicy.MUST_SAVE}
    recomputed = {op for op, p in decisions if p == CheckpointPolicy.PREFER_RECOMPUTE}
    assert "aten.mm" in kept and any("scaled_dot_product" in op for op in kept), kept
    assert kept <= {op.replace("higher_order.", "") for op in activations.SAVED_OPS} | {"flex_attention"}, kept
    assert {"aten.mul", "aten.rsqrt", "aten.silu"} <= recomputed, recomputed
    lora_mm = sum(1 for op, p in decisions if op == "aten.mm")
    assert lora_mm >= 2 * 7 * 2  # 2 layers x 7 LoRA-wrapped linears x (base + A + B) >= 2 mm each


@pytest.mark.parametrize(("keys", "match"), [
    ({"checkpoint_every": 2}, "gradient_checkpointing: true"),
    ({"checkpoint_scope": "mlp"}, "gradient_checkpointing: true"),
    ({"gradient_checkpointing": True, "offload_activations": True}, "offloads nothing"),
    ({"gradient_checkpointing": True, "checkpoint_scope": "elementwise", "offload_activations": True},
     "offloads nothing"),
    ({"compile_layers": True, "offload_activations": True}, "set one of them"),
    ({"compile_layers": True, "gradient_checkpointing": True, "checkpoint_scope": "elementwise"}, "untested"),
    ({"gradient_checkpointing": "auto", "checkpoint_every": 2}, "auto may turn it off"),
    ({"gradient_checkpointing": "auto", "offload_activations": True}, "depend on the machine"),
])
def test_settings_without_an_effect_are_refused(keys, match):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=match):
        TrainConfig(model="m", **{"gradient_checkpointing": False, **keys})


def test_mlp_scope_needs_an_mlp_block():
    from tidal.config.load import ConfigError

    model = policy("llama3", {}, layers=2)
    for layer in decoder_layers(model):
        del layer.mlp
    with pytest.raises(ConfigError, match="checkpoint_scope: mlp"):
        apply_activation_policy(model, TrainConfig(model="m", gradient_checkpointing=True, checkpoint_scope="mlp"),
                                torch.device("cpu"))


@pytest.mark.slow
def test_compiled_layers_give_the_same_logprobs_and_gradients():
    """`compile_layers` (torch.compile of every decoder layer; inductor on CPU here) with LoRA and checkpointing:
    the eager logprobs and gradients (float32; the compiled kernels fuse and reorder elementwise work)."""
    rng = np.random.default_rng()
    ids = torch.from_numpy(rng.integers(3, 120, (1, 64)))
    pos = torch.arange(64)[None]
    w = torch.from_numpy(rng.normal(size=ids.shape)).float()
    keys = {"gradient_checkpointing": True}
    eager = step(policy("llama3", keys, layers=2, dtype=torch.float32), ids, pos, w)
    model = policy("llama3", keys, layers=2, dtype=torch.float32)
    assert compile_layers(model) == 2
    compiled = step(model, ids, pos, w)
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=1e-4)
    for n, g in eager[1].items():
        torch.testing.assert_close(compiled[1][n], g, rtol=1e-3, atol=1e-5, msg=n)


def test_compiled_layers_share_their_graphs_and_stop_recompiling_after_two_lengths():
    """`compile_layers` counted with dynamo's eager backend (no inductor: fast), dense SDPA attention (one graph per
    layer, no per-sample loop), checkpointing on: the two layers share one graph, a second row length compiles the
    dynamic one, a third and fourth compile nothing; the logprobs and gradients are eager's."""
    from tidal.trainer.model import kernels

    rng = np.random.default_rng()
    keys = {"gradient_checkpointing": True}
    model = policy("llama3", keys, layers=2, dtype=torch.float32, attn="sdpa")
    assert compile_layers(model, backend="eager") == 2
    before, graphs = kernels.compiled_graphs(), []
    for n in (64, 48, 80, 96):
        ids = torch.from_numpy(rng.integers(3, 120, (1, n)))
        pos = packed_positions(rng, 1, n, pad=False)
        w = torch.from_numpy(rng.normal(size=ids.shape)).float()
        compiled = step(model, ids, pos, w)
        graphs.append(kernels.compiled_graphs() - before)
    assert graphs == [1, 2, 2, 2] and graphs[-1] <= kernels.GRAPHS_PER_CLASS
    eager = step(policy("llama3", keys, layers=2, dtype=torch.float32, attn="sdpa"), ids, pos, w)
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=1e-5)
    for n, g in eager[1].items():
        torch.testing.assert_close(compiled[1][n], g, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_dropout_zero_makes_no_copy(dropout):
    """PEFT (0.21) puts `nn.Identity` in place of the dropout when `lora_dropout` is 0, so the adapter's A matmul
    saves the layer's input tensor itself (no copy per LoRA layer); with dropout > 0 it saves a dropped-out copy
    and a mask. Checked on every LoRA layer's saved tensors, so no code change is needed in
    tidal for this (issue 27)."""
    model = policy("llama3", {"lora_dropout": dropout}, layers=1)
    lora_layers = [m for m in model.modules() if hasattr(m, "lora_dropout") and "default" in m.lora_dropout]
    assert lora_layers
    assert all(isinstance(m.lora_dropout["default"], torch.nn.Identity) == (dropout == 0) for m in lora_layers)
    layer = model.get_submodule("base_model.model.model.layers.0.mlp.down_proj")
    inputs, saved = [], set()
    layer.register_forward_pre_hook(lambda _m, args: inputs.append(args[0].untyped_storage().data_ptr()))

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.numel() == x.numel():  # activations the size of the input (not weights, not the rank-4 A output)
            saved.add(t.untyped_storage().data_ptr())
        return t

    x = torch.randn(1, 8, 256, dtype=torch.float64, requires_grad=True)
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    # tensors saved for the backward with the size of the input (the frozen base matmul saves none): the input
    # itself for lora_A; with dropout the dropped-out copy and its mask instead
    if dropout == 0:
        assert saved == {inputs[0]}
    else:
        assert inputs[0] not in saved and len(saved) == 2


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make test-gpu on a GPU)")


@pytest.mark.gpu
@needs_cuda
def test_on_cuda_offload_and_partial_checkpointing_keep_less_on_the_device():
    """bfloat16 on CUDA with flex attention, 4 layers, a 4,096-token packed row: the device memory held between
    forward and backward orders as expected, and compiled layers give the eager logprobs within bf16 rounding."""
    from transformers import AutoModelForCausalLM

    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(3, 120, (1, 4096))).to(dev)
    pos = packed_positions(rng, 1, 4096, pad=False).to(dev)
    held, lps = {}, {}
    for k, keys in {"none": {}, "every 2nd layer": SETTINGS["every 2nd layer"], "mlp": SETTINGS["mlp"],
                    "offload": SETTINGS["offload"], "compiled": {"compile_layers": True}}.items():
        cfg = TrainConfig(model="m", lora_rank=4, attention="flex", **{"gradient_checkpointing": False, **keys})
        torch.manual_seed(0)
        conf = config_for("qwen3")
        conf.num_hidden_layers, conf.layer_types = 4, ["full_attention"] * 4
        from tidal.trainer.model.hf import attn_implementation
        from tidal.trainer.model.load import prepare_policy

        model = AutoModelForCausalLM.from_config(conf, attn_implementation=attn_implementation(dev, "flex"),
                                                 dtype=torch.bfloat16).to(dev)
        model = prepare_policy(model, cfg, dev)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        lp = forward_logprobs(model, ids, pos, chunk_size=0)
        held[k] = torch.cuda.memory_allocated() - before
        lp.sum().backward()
        lps[k] = lp.detach().float()
        del model, lp
    assert held["offload"] < held["every 2nd layer"] < held["none"] and held["mlp"] < held["none"]
    for k, lp in lps.items():
        assert float((lp - lps["none"]).abs().mean()) < 2e-2, k
