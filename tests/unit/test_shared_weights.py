"""Shared base weights (train `share_base_weights`): the name/view mapping against vLLM's real fused layouts,
the trainer's base built from vLLM's tensors, the bytes the split can subtract, and the co-locate derivation.

vLLM's side is real: `tests.unit.vllm_layouts` builds vLLM's model class of each tiny architecture on CPU and
loads the checkpoint with the model's own `load_weights` (one subprocess, ~15 s, for every architecture of
`VERIFIED`). What needs CUDA (the IPC handles themselves, vLLM on a GPU) is in tests/unit/test_shared_weights_gpu.py.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.archs import ARCHS, config_for
from tidal.colocate.derive import Machine, ModelFacts, derive_colocate
from tidal.config import ConfigError, InferConfig, OrchConfig, TrainConfig
from tidal.models import shared_weights as sw

ROOT = Path(__file__).resolve().parents[2]
SHARED_ARCHS = {name: arch for name, arch in ARCHS.items()
                if f"{arch.config_class.removesuffix('Config')}ForCausalLM" in sw.VERIFIED}


def test_every_verified_architecture_is_built_here():
    """The vLLM comparison below covers every architecture the mapping claims (and Olmo 2, served by vLLM's
    transformers backend, is not claimed)."""
    built = {f"{a.config_class.removesuffix('Config')}ForCausalLM" for a in SHARED_ARCHS.values()}
    assert built == set(sw.VERIFIED)
    assert "olmo2" in ARCHS and "olmo2" not in SHARED_ARCHS


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("layouts")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "tests.unit.vllm_layouts", str(out), *SHARED_ARCHS],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


@pytest.mark.parametrize("name", sorted(SHARED_ARCHS))
def test_views_of_vllm_tensors_are_the_hf_weights(layouts, name):
    """Every non-norm parameter of the Hugging Face model equals its view of the tensor vLLM built by loading the
    same checkpoint (exactly: the same float32 values); the fused ones really are slices of a fused tensor."""
    vllm = load_file(str(layouts / name / "vllm.safetensors"))
    model = hf_model(layouts / name)
    params = dict(model.named_parameters())
    plan = sw.view_plan(model.config.architectures[0], {n: tuple(p.shape) for n, p in params.items()},
                        {n: tuple(t.shape) for n, t in vllm.items()})
    assert set(plan.shared) | set(plan.unshared) == set(params)
    assert all(n.endswith(sw.UNSHARED_SUFFIXES) for n in plan.unshared)
    for hf_name, view in plan.shared.items():
        got = vllm[view.vllm_name].narrow(view.dim, view.start, view.length)
        assert torch.equal(got, params[hf_name].detach()), (hf_name, view)
    fused = [v for v in plan.shared.values() if v.length < vllm[v.vllm_name].shape[0]]
    if name != "phi3":  # Phi-3's checkpoint is already fused: its views are whole tensors
        assert any(v.start > 0 for v in fused)
    if name == "qwen3-moe":
        assert any(v.vllm_name.endswith("w13_weight") for v in plan.shared.values())


@pytest.mark.parametrize("name", ["llama3", "qwen3-moe", "gemma2", "qwen2.5"])
def test_trainer_base_built_from_vllm_tensors_gives_the_same_logprobs(layouts, name):
    """The trainer's model with views of vLLM's tensors (norms from disk, buffers by transformers) computes the
    logits of the normally loaded model; the shared parameters are vLLM's memory (no copy) and frozen."""
    from tidal.trainer.model.shared_base import build_from_tensors, check_against_checkpoint

    model_dir = layouts / name
    vllm = load_file(str(model_dir / "vllm.safetensors"))
    ref = hf_model(model_dir).eval()
    config = ref.config
    from transformers import AutoModelForCausalLM

    shared, plan = build_from_tensors(config, AutoModelForCausalLM, vllm, model_dir, torch.device("cpu"),
                                      torch.float32, "sdpa")
    shared.eval()
    assert check_against_checkpoint(shared, plan, model_dir) > 0
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = ref(input_ids=ids).logits.double(), shared(input_ids=ids).logits.double()
    torch.testing.assert_close(got.log_softmax(-1), want.log_softmax(-1), rtol=0, atol=1e-5)
    pointers = {t.untyped_storage().data_ptr() for t in vllm.values()}
    for hf_name in plan.shared:
        p = shared.get_parameter(hf_name)
        assert not p.requires_grad and p.untyped_storage().data_ptr() in pointers, hf_name


@pytest.mark.parametrize(("name", "fused", "culprit"), [
    ("llama3", "model.layers.0.self_attn.qkv_proj.weight", "q_proj"),
    ("qwen3-moe", "model.layers.0.mlp.experts.routed_experts.w13_weight", "experts.0.gate_proj"),
])
def test_a_layout_vllm_changed_is_caught(layouts, name, fused, culprit):
    """vLLM's fused rows in another order (as a kernel-specific repack would leave them: reversed qkv rows,
    experts' up before gate) build a model of the right shapes; the check against the checkpoint names it."""
    from transformers import AutoModelForCausalLM

    from tidal.trainer.model.shared_base import build_from_tensors, check_against_checkpoint

    model_dir = layouts / name
    vllm = load_file(str(model_dir / "vllm.safetensors"))
    model, plan = build_from_tensors(hf_model(model_dir).config, AutoModelForCausalLM, vllm, model_dir,
                                     torch.device("cpu"), torch.float32, "sdpa")
    assert check_against_checkpoint(model, plan, model_dir) >= 4
    vllm[fused] = vllm[fused].flip(-2).contiguous()
    model, plan = build_from_tensors(hf_model(model_dir).config, AutoModelForCausalLM, vllm, model_dir,
                                     torch.device("cpu"), torch.float32, "sdpa")
    with pytest.raises(sw.SharingRefused, match=f"differs from the checkpoint's .*{culprit}"):
        check_against_checkpoint(model, plan, model_dir)


def test_vllm_tensors_of_another_dtype_are_refused(layouts):
    from transformers import AutoModelForCausalLM

    from tidal.trainer.model.shared_base import build_from_tensors

    model_dir = layouts / "llama3"
    vllm = {n: t.to(torch.bfloat16) for n, t in load_file(str(model_dir / "vllm.safetensors")).items()}
    with pytest.raises(sw.SharingRefused, match="another dtype"):
        build_from_tensors(hf_model(model_dir).config, AutoModelForCausalLM, vllm, model_dir, torch.device("cpu"),
                           torch.float32, "sdpa")


def meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "tie_word_embeddings": False, "max_position_embeddings": 131072}


@pytest.mark.parametrize("name", [*sorted(SHARED_ARCHS), "llama-3.1-8b"])
def test_shared_bytes_count_every_shared_parameter_once(name):
    """`shared_bytes(config.json)` equals the bytes of the parameters the plan shares, counted on the model
    itself (meta device), for each verified architecture and the Llama-3.1-8B shape (15.0 GiB in bf16)."""
    from transformers import LlamaConfig

    config = LlamaConfig(**LLAMA_8B) if name == "llama-3.1-8b" else config_for(name)
    model = meta_model(config)
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    shared = [n for n in params if not n.endswith(sw.UNSHARED_SUFFIXES)]
    count = sum(model.get_parameter(n).numel() for n in shared)
    as_json = {**config.to_dict(), "architectures": [type(model).__name__]}  # as config.json has it
    assert sw.shared_param_count(as_json) == count
    assert sw.shared_bytes(as_json) == 2 * count
    if name == "llama-3.1-8b":
        assert 14.9 < sw.shared_bytes(LLAMA_8B) / 2**30 < 15.0


def test_unverified_architectures_and_partial_groups_are_refused():
    with pytest.raises(sw.SharingRefused, match="Olmo2ForCausalLM.*not verified"):
        sw.view_plan("Olmo2ForCausalLM", {}, {})
    with pytest.raises(sw.SharingRefused, match="Olmo2ForCausalLM"):
        sw.shared_bytes({"architectures": ["Olmo2ForCausalLM"]})
    hf = {"model.layers.0.self_attn.k_proj.weight": (64, 128)}  # k without q: no known offset
    with pytest.raises(sw.SharingRefused, match="partial fused group"):
        sw.view_plan("LlamaForCausalLM", hf, {"model.layers.0.self_attn.qkv_proj.weight": (256, 128)})
    hf = {"model.layers.0.self_attn.o_proj.weight": (128, 128)}  # a tp=2 shard of vLLM's o_proj
    with pytest.raises(sw.SharingRefused, match="does not fit"):
        sw.view_plan("LlamaForCausalLM", hf, {"model.layers.0.self_attn.o_proj.weight": (128, 64)})


def test_vllm_wrapper_levels_are_ignored_and_padded_vocabularies_sliced():
    """LoRA-enabled vLLM names (`.base_layer`) and vLLM 0.32's `.routed_experts` map to the plain names; an
    embedding padded to vLLM's multiple of 64 rows is viewed as its first vocab rows."""
    hf = {"model.embed_tokens.weight": (100, 8), "model.layers.0.self_attn.q_proj.weight": (8, 8),
          "model.layers.0.self_attn.k_proj.weight": (4, 8), "model.layers.0.self_attn.v_proj.weight": (4, 8),
          "model.layers.0.mlp.experts.gate_up_proj": (2, 6, 8)}
    vllm = {"model.embed_tokens.base_layer.weight": (128, 8),
            "model.layers.0.self_attn.qkv_proj.base_layer.weight": (16, 8),
            "model.layers.0.mlp.experts.routed_experts.w13_weight": (2, 6, 8)}
    plan = sw.view_plan("Qwen3MoeForCausalLM", hf, vllm)
    assert plan.shared["model.embed_tokens.weight"] == sw.View("model.embed_tokens.base_layer.weight", 0, 0, 100)
    assert plan.shared["model.layers.0.self_attn.v_proj.weight"].start == 12
    assert plan.shared["model.layers.0.mlp.experts.gate_up_proj"].vllm_name.endswith("routed_experts.w13_weight")


# --- the co-locate derivation (pure; fake machines) ---

GPU = Machine(cores=tuple(range(16)), has_gpu=True)
CPU = Machine(cores=(0, 1))


def configs(**train):
    train.setdefault("share_base_weights", "auto")  # the default is false until the CUDA path has run
    return (TrainConfig(model="m", **train), InferConfig(model="m"),
            OrchConfig())


def derive(machine=GPU, arch="LlamaForCausalLM", infer=None, orch=None, **train):
    t, i, o = configs(**train)
    return derive_colocate(t, infer or i, orch or o, machine, model=ModelFacts(architecture=arch))


def test_auto_shares_on_one_gpu_and_wires_both_sides():
    co = derive()
    assert co.train.share_base_weights is True
    assert co.train.base_weights_url == co.placement.base_url
    assert co.infer.export_base_weights is True
    assert any(n.startswith("GPU: base weights shared") for n in co.placement.notices)


def test_auto_is_off_on_cpu_silently_and_true_exits_2():
    co = derive(CPU)
    assert co.train.share_base_weights == "auto" and not co.infer.export_base_weights  # the trainer: off
    assert not any("shared" in n for n in co.placement.notices)
    with pytest.raises(ConfigError, match="share_base_weights is true.*CUDA IPC"):
        derive(CPU, share_base_weights=True)


def test_the_default_is_off_without_a_notice():
    co = derive_colocate(TrainConfig(model="m"), InferConfig(model="m"), OrchConfig(), GPU,
                         model=ModelFacts(architecture="LlamaForCausalLM"))
    assert co.train.share_base_weights is False and not co.infer.export_base_weights
    assert not any("shared" in n for n in co.placement.notices)


def test_false_keeps_the_trainers_own_copy():
    co = derive(share_base_weights=False)
    assert co.train.share_base_weights is False and not co.infer.export_base_weights


@pytest.mark.parametrize(("kw", "why"), [
    ({"train": {"lora": False}}, "full fine-tuning"),
    ({"train": {"qlora_bnb": True}}, "qlora"),
    ({"train": {"recipe": "fp8-hybrid"}}, "recipe fp8-hybrid"),
    ({"infer": {"dtype": "float16"}}, "infer dtype float16"),
    ({"infer": {"tp": 2}, "train": {"gpus": 2}}, "gpus 2"),
    ({"infer": {"extra_args": ["--quantization", "fp8"]}}, "quantiz"),
    ({"orch": {"weight_broadcast": {"type": "nccl"}}}, "merged weights into vLLM"),
    ({"orch": {"weight_broadcast": {"reload": "merged"}}}, "merged weights into vLLM"),
    ({"train": {"noise_scheduler": {"enabled": True}, "max_steps": 10}}, "QeRL"),
    ({"arch": "Olmo2ForCausalLM"}, "not verified"),
    ({"arch": None}, "architecture is unknown"),
])
def test_where_sharing_cannot_apply(kw, why):
    """`auto` turns off with a notice giving the reason; `true` is a config error with the same reason."""
    t, i, o = configs(**kw.get("train", {}))
    i = i.model_copy(update=kw.get("infer", {}))
    if "orch" in kw:
        o = OrchConfig.model_validate(kw["orch"])
    arch = kw.get("arch", "LlamaForCausalLM")
    co = derive_colocate(t, i, o, GPU, model=ModelFacts(architecture=arch))
    assert co.train.share_base_weights == "auto" and not co.infer.export_base_weights
    assert any("not shared" in n and why in n for n in co.placement.notices), co.placement.notices
    with pytest.raises(ConfigError, match=why):
        derive_colocate(t.model_copy(update={"share_base_weights": True}), i, o, GPU,
                        model=ModelFacts(architecture=arch))


def test_the_memory_split_sees_the_resolved_setting_and_counts_the_base_once():
    """The split is asked with `share_base_weights` already resolved, and subtracts `shared_bytes` from the
    trainer's estimate and its measured peak: a trainer that needs its own 15 GiB copy of an 8B base beside vLLM's
    does not fit on an 80 GiB GPU, the same trainer on vLLM's copy does."""
    import re

    from tidal.colocate.split import split_updates
    from tidal.models.memory import train_estimate

    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "vocab_size": 128256, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    co = derive_colocate(*configs(), Machine(cores=(0,), has_gpu=True, gpu_memory_gib=80.0),
                         model=ModelFacts(architecture="LlamaForCausalLM", config=cfg))
    assert co.train.share_base_weights is True
    note = next(n for n in co.placement.notices if "trainer needs" in n)
    estimate_gib = train_estimate(co.train, "checkpointing on" in note, model_config=cfg).total_gib
    split_need = float(re.search(r"trainer needs ([0-9.]+) of", note).group(1))
    assert split_need == pytest.approx(estimate_gib - sw.shared_bytes(cfg) / 2**30, abs=0.051), \
        "the split is asked with share_base_weights resolved (true), so it counts the base once"
    shared_gib = sw.shared_bytes(cfg) / 2**30
    assert 14.5 < shared_gib < 15.5
    infer, orch = InferConfig(model="m", dtype="bfloat16"), OrchConfig()
    measured = []

    def run(share, estimate):
        train = TrainConfig(model="m", gradient_checkpointing=True, share_base_weights=share)
        return split_updates(train, infer, orch, 80.0, model_config=cfg, kv_bytes_arg=True,
                             estimate_gib=lambda t, ckpt: estimate,
                             measure_gib=lambda t, ckpt: measured.append(estimate) or estimate)
    # find an estimate that just does not fit with the trainer's own copy
    estimate = 80.0
    while True:
        try:
            run(False, estimate)
            break
        except ConfigError:
            estimate -= 1.0
    too_big = estimate + 1.0 + 0.5 * shared_gib
    with pytest.raises(ConfigError):
        run(False, too_big)
    _, _, note = run(True, too_big)  # fits: the shared base is counted once, in vLLM's share

    need = float(re.search(r"trainer needs ([0-9.]+) of", note).group(1))
    assert need < too_big - 0.5 * shared_gib  # the estimate less the shared base (plus overhead and margin)


# --- the vLLM side's command line, and the trainer side without a server ---

def test_vllm_gets_the_worker_extension_dev_routes_and_kv_cache_dtype():
    from tidal.inference.backends.vllm.server import WORKER_EXTENSION, vllm_argv, vllm_env

    argv = vllm_argv(InferConfig(model="tidal:tiny-reverse", export_base_weights=True, kv_cache_dtype="fp8"))
    assert argv[argv.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"
    assert vllm_env(InferConfig(model="m", export_base_weights=True))["VLLM_SERVER_DEV_MODE"] == "1"
    plain = vllm_argv(InferConfig(model="tidal:tiny-reverse"))
    assert "--worker-extension-cls" not in plain and "--kv-cache-dtype" not in plain
    module, _, cls = WORKER_EXTENSION.rpartition(".")
    assert hasattr(__import__(module, fromlist=[cls]), cls)


def test_grpo_infer_refuses_export_on_cpu(tmp_path):
    """`tidal grpo-infer` with export_base_weights on this CPU-only machine exits 2 before vLLM starts."""
    cfg = tmp_path / "infer.yaml"
    cfg.write_text("model: tidal:tiny-reverse\nexport_base_weights: true\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo-infer", str(cfg)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "export_base_weights" in proc.stderr and "CPU" in proc.stderr


def test_trainer_refuses_sharing_without_a_server_or_gpu():
    from tidal.trainer.model.shared_base import load_shared_base

    with pytest.raises(ConfigError, match="base_weights_url is unset"):
        load_shared_base(TrainConfig(model="tidal:tiny-reverse", share_base_weights=True), torch.device("cpu"),
                         torch.float32)
    cfg = TrainConfig(model="tidal:tiny-reverse", share_base_weights=True, base_weights_url="http://x:1/v1")
    with pytest.raises(ConfigError, match="CUDA IPC needs a GPU"):
        load_shared_base(cfg, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize(("train", "why"), [({"lora": False}, "full fine-tuning"), ({"qlora_fp8": True}, "qlora"),
                                            ({"broadcast_merged": True}, "merged weights")])
def test_grpo_train_alone_checks_the_trainer_side(train, why):
    """`grpo-train` with `share_base_weights: true` and a URL (three processes on one GPU) still refuses a trainer
    that cannot run on vLLM's frozen tensors (checked before any GPU call)."""
    from tidal.models.shared_weights import train_refusal

    assert train_refusal(TrainConfig(model="m")) is None
    assert why in (train_refusal(TrainConfig(model="m", **train)) or "")


# --- the IPC handle codec (JSON, no pickle) ---

def test_ipc_handles_are_json_and_rebuild_with_the_trainers_device_index():
    """A handle as the worker encodes it survives JSON and becomes `rebuild_cuda_tensor`'s arguments with the
    trainer's device index and the exact bytes; CPU tensors, other formats and unknown classes are refused."""
    from tidal.inference.backends.vllm import ipc

    handle, ref = os.urandom(64), b"/torch_1234_5678_0"
    entry = {"format": ipc.FORMAT, "tensor_cls": "Tensor", "size": [256, 128], "stride": [128, 1], "offset": 128,
             "storage_cls": "TypedStorage", "dtype": "bfloat16", "device": 3,
             "handle": base64.b64encode(handle).decode(), "storage_size_bytes": 65536, "storage_offset_bytes": 512,
             "requires_grad": False, "ref_counter_handle": base64.b64encode(ref).decode(), "ref_counter_offset": 7,
             "event_handle": None, "event_sync_required": False}
    args = ipc.rebuild_args(json.loads(json.dumps(entry)), device_index=0)
    assert args[:7] == (torch.Tensor, torch.Size([256, 128]), (128, 1), 128, torch.storage.TypedStorage,
                        torch.bfloat16, 0)
    assert args[7] == handle and args[11] == ref and args[12] == 7 and args[13] is None
    with pytest.raises(ValueError, match="format"):
        ipc.rebuild_args({**entry, "format": 99}, 0)
    with pytest.raises(ValueError, match="not one tidal rebuilds"):
        ipc.rebuild_args({**entry, "storage_cls": "os.system"}, 0)
    with pytest.raises(ValueError, match="dtype"):
        ipc.rebuild_args({**entry, "dtype": "Tensor"}, 0)
    with pytest.raises(ValueError, match="CUDA tensors only"):
        ipc.encode(torch.zeros(2))


def test_tidal_grpo_with_sharing_forced_on_cpu_exits_2(tmp_path):
    """`tidal grpo --train.share_base_weights true` on this CPU-only machine: exit 2 with the reason, nothing
    started (the run directory gets no logs)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo", "--output-dir", str(tmp_path / "run"),
                           "--train.share_base_weights", "true"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "share_base_weights is true" in proc.stderr and "CUDA IPC" in proc.stderr
    assert not (tmp_path / "run" / "logs").exists()
