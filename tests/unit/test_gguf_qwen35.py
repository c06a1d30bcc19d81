"""GGUF out for Qwen3.5 text models, dense and MoE (`tidal.trainer.publish.gguf_qwen35`, Qwen's pre-tokenizers in
`gguf_vocab`): what is written, read back with `gguf.GGUFReader`, and what is refused up front.

Models are the random-init tiny Qwen3.5 of `tests/qwen35_tiny.py` (Qwen3.5-shaped byte-level BPE tokenizer; 2 key /
4 value heads in the delta-net, or 2 / 2; a Qwen3.5-MoE with 4 experts and a shared one). The real llama.cpp check
is tests/e2e/test_gguf_qwen35_llama_cpp.py (slow): greedy completions and logits equal transformers', and other
logits when a convention is dropped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf", reason="the gguf extra (pip install -e '.[gguf]'; make setup-dev installs it)")
torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from tests.qwen35_tiny import build, qwen35_tokenizer  # noqa: E402
from tidal.config.load import ConfigError  # noqa: E402
from tidal.trainer.publish.gguf_out import check_gguf_export, gguf_out_support, hparam_problems, write_gguf  # noqa: E402
from tidal.trainer.publish.gguf_qwen35 import reorder_v_heads, unpositioned_pairs  # noqa: E402
from tidal.trainer.publish.gguf_vocab import choose_pre  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def read(path: Path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(str(path))
    return ({k: v.contents() for k, v in r.fields.items()},
            {t.name: (np.asarray(t.data), t.tensor_type.name) for t in r.tensors})


def tiled(n_k: int, per_k: int) -> list[int]:
    """Value head at each tiled position (llama.cpp: position p reads key head p % n_k): p = j * n_k + g holds the
    grouped head g * per_k + j (transformers: value head h reads key head h // per_k)."""
    return [(p % n_k) * per_k + p // n_k for p in range(n_k * per_k)]


@pytest.mark.parametrize("n_k, per_k, dim", [(2, 2, 3), (3, 4, 1), (1, 3, 2)])
def test_v_head_reorder_is_grouped_to_tiled(n_k, per_k, dim):
    """Rows (and, on axis 1, columns) of value heads move so that tiled position p holds grouped head `tiled(p)`:
    then each keeps the key head it reads (`p % n_k` in llama.cpp == `head // per_k` in transformers)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n_k * per_k * dim, 5)).astype(np.float32)
    out = reorder_v_heads(a, 0, n_k, per_k, dim)
    for p, head in enumerate(tiled(n_k, per_k)):
        assert np.array_equal(out[p * dim:(p + 1) * dim], a[head * dim:(head + 1) * dim])
        assert p % n_k == head // per_k
    assert np.array_equal(reorder_v_heads(a.T, 1, n_k, per_k, dim), out.T)


def test_keys_tensors_and_conventions(tmp_path):
    """The qwen35 keys (delta-net sizes, per-layer recurrent flags from layer_types: not llama.cpp's default period
    of 4, rotary dims 32 x 0.25, default MRoPE sections); every tensor named as llama.cpp loads it: A_log as
    -exp(A_log), dt_bias as ssm_dt.bias, the conv squeezed, norms + 1 but the gated one, V heads reordered, the
    gated q_proj as it is; tied (no output.weight); the conv kernel F32 in an F16 file."""
    src = tmp_path / "src"
    model = build("qwen3.5", src)
    s = {k: v.numpy() for k, v in model.state_dict().items()}
    f, t = read(write_gguf(model.state_dict().items(), src, tmp_path / "m.gguf", "f32"))
    assert f["general.architecture"] == "qwen35"
    assert (f["qwen35.ssm.conv_kernel"], f["qwen35.ssm.state_size"], f["qwen35.ssm.group_count"],
            f["qwen35.ssm.time_step_rank"], f["qwen35.ssm.inner_size"]) == (4, 32, 2, 4, 128)
    assert list(f["qwen35.attention.recurrent_layers"]) == [True, False, True]
    assert f["qwen35.rope.dimension_count"] == 8 and list(f["qwen35.rope.dimension_sections"]) == [11, 11, 10, 0]
    assert f["qwen35.attention.key_length"] == 32 and f["qwen35.attention.head_count_kv"] == 2
    assert f["tokenizer.ggml.pre"] == "qwen35" and "output.weight" not in t and "qwen35.nextn_predict_layers" not in f
    order = tiled(2, 2)  # 2 key heads, 2 value heads each

    def heads(a, dim, axis=0):
        parts = np.split(a, 4, axis=axis)
        return np.concatenate([parts[h] for h in order], axis=axis)

    p = "model.layers.0.linear_attn."
    assert np.allclose(t["blk.0.ssm_a"][0], -np.exp(heads(s[p + "A_log"], 1)))
    assert np.array_equal(t["blk.0.ssm_dt.bias"][0], heads(s[p + "dt_bias"], 1))
    conv = s[p + "conv1d.weight"][:, 0, :]  # (C, K): q, k channels (2 x 64), then v (128)
    assert np.array_equal(t["blk.0.ssm_conv1d.weight"][0], np.concatenate([conv[:128], heads(conv[128:], 32)]))
    qkv = s[p + "in_proj_qkv.weight"]
    assert np.array_equal(t["blk.0.attn_qkv.weight"][0], np.concatenate([qkv[:128], heads(qkv[128:], 32)]))
    assert np.array_equal(t["blk.0.attn_gate.weight"][0], heads(s[p + "in_proj_z.weight"], 32))
    assert np.array_equal(t["blk.0.ssm_alpha.weight"][0], heads(s[p + "in_proj_a.weight"], 1))
    assert np.array_equal(t["blk.0.ssm_beta.weight"][0], heads(s[p + "in_proj_b.weight"], 1))
    assert np.array_equal(t["blk.0.ssm_out.weight"][0], heads(s[p + "out_proj.weight"], 32, axis=1))
    assert np.array_equal(t["blk.0.ssm_norm.weight"][0], s[p + "norm.weight"])  # the gated norm: x * w in both
    for key, name in (("model.layers.0.input_layernorm.weight", "blk.0.attn_norm.weight"),
                      ("model.layers.0.post_attention_layernorm.weight", "blk.0.post_attention_norm.weight"),
                      ("model.layers.1.self_attn.q_norm.weight", "blk.1.attn_q_norm.weight"),
                      ("model.layers.1.self_attn.k_norm.weight", "blk.1.attn_k_norm.weight"),
                      ("model.norm.weight", "output_norm.weight")):
        assert np.array_equal(t[name][0], s[key] + np.float32(1.0)), key
    assert np.array_equal(t["blk.1.attn_q.weight"][0], s["model.layers.1.self_attn.q_proj.weight"])
    assert t["blk.1.attn_q.weight"][0].shape == (4 * 32 * 2, 128)  # query and gate rows per head
    _, t16 = read(write_gguf(model.state_dict().items(), src, tmp_path / "h.gguf", "f16"))
    assert t16["blk.0.ssm_conv1d.weight"][1] == "F32" and t16["blk.0.attn_qkv.weight"][1] == "F16"


def test_equal_key_and_value_heads_are_not_reordered(tmp_path):
    src = tmp_path / "src"
    model = build("qwen3.5-kv-equal", src)
    s = {k: v.numpy() for k, v in model.state_dict().items()}
    f, t = read(write_gguf(model.state_dict().items(), src, tmp_path / "m.gguf", "f32"))
    assert f["qwen35.ssm.time_step_rank"] == 2 and f["qwen35.ssm.group_count"] == 2
    assert np.array_equal(t["blk.2.attn_gate.weight"][0], s["model.layers.2.linear_attn.in_proj_z.weight"])
    assert np.array_equal(t["output.weight"][0], s["lm_head.weight"])  # untied


def test_the_text_path_of_a_vision_language_checkpoint(tmp_path):
    """A `qwen3_5` checkpoint (transformers 5's names: model.language_model.*, the vision tower model.visual.*, and a
    multi-token-prediction head mtp.* that transformers does not load): written from its text_config, the vision
    tower and the MTP head left out, the same file as the text model's."""
    src = tmp_path / "text"
    model = build("qwen3.5", src)
    text_cfg = json.loads((src / "config.json").read_text())
    f_text, t_text = read(write_gguf(model.state_dict().items(), src, tmp_path / "text.gguf", "f32"))
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    for p in src.iterdir():
        if p.name != "config.json" and p.is_file():
            (vlm / p.name).write_bytes(p.read_bytes())
    (vlm / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "tie_word_embeddings": True,
        "text_config": {**text_cfg, "mtp_num_hidden_layers": 1}, "vision_config": {"depth": 1}}))
    weights = [(k.replace("model.", "model.language_model.", 1), v) for k, v in model.state_dict().items()]
    weights += [("model.visual.blocks.0.attn.qkv.weight", torch.ones(3, 3)),
                ("mtp.layers.0.self_attn.q_proj.weight", torch.ones(3, 3)), ("mtp.fc.weight", torch.ones(3, 3))]
    assert gguf_out_support("qwen3_5") == (True, "qwen35 (text model)")
    f, t = read(write_gguf(weights, vlm, tmp_path / "vlm.gguf", "f32"))
    assert set(t) == set(t_text)
    assert all(np.array_equal(t[n][0], t_text[n][0]) for n in t)
    assert f["qwen35.block_count"] == f_text["qwen35.block_count"] == 3


def test_moe_experts_router_and_shared_expert(tmp_path):
    """Qwen3.5-MoE (`qwen35moe`): expert keys; the router, the experts as (E, rows, cols) gate / up / down (the
    in-memory fused gate_up_proj split in halves, gate first) and the shared expert with its gate; the checkpoint
    transformers saves (per-expert tensors) gives the same tensors; a layer missing an expert is an error."""
    from safetensors.torch import load_file

    src = tmp_path / "src"
    model = build("qwen3.5-moe", src)
    s = {k: v.numpy() for k, v in model.state_dict().items()}
    f, t = read(write_gguf(model.state_dict().items(), src, tmp_path / "m.gguf", "f32"))
    assert f["general.architecture"] == "qwen35moe"
    assert (f["qwen35moe.expert_count"], f["qwen35moe.expert_used_count"], f["qwen35moe.expert_feed_forward_length"],
            f["qwen35moe.expert_shared_feed_forward_length"]) == (4, 2, 64, 96)
    assert "qwen35moe.feed_forward_length" not in f and list(f["qwen35moe.attention.recurrent_layers"]) == [True,
                                                                                                         False, True]
    p = "model.layers.1.mlp."
    gate_up = s[p + "experts.gate_up_proj"]  # (4, 128, 128): 64 gate rows, then 64 up rows per expert
    assert np.array_equal(t["blk.1.ffn_gate_exps.weight"][0], gate_up[:, :64])
    assert np.array_equal(t["blk.1.ffn_up_exps.weight"][0], gate_up[:, 64:])
    assert np.array_equal(t["blk.1.ffn_down_exps.weight"][0], s[p + "experts.down_proj"])
    assert np.array_equal(t["blk.1.ffn_gate_inp.weight"][0], s[p + "gate.weight"])
    assert np.array_equal(t["blk.1.ffn_gate_inp_shexp.weight"][0], s[p + "shared_expert_gate.weight"])
    assert np.array_equal(t["blk.1.ffn_down_shexp.weight"][0], s[p + "shared_expert.down_proj.weight"])
    saved = load_file(str(src / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in saved  # transformers 5 saves experts one by one
    _, t2 = read(write_gguf(saved.items(), src, tmp_path / "saved.gguf", "f32"))
    assert set(t2) == set(t) and all(np.array_equal(t2[n][0], t[n][0]) for n in t)
    del saved["model.layers.2.mlp.experts.1.down_proj.weight"]
    with pytest.raises(ValueError, match=r"experts missing of 4: model.layers.2.mlp.experts.\*.down_proj has "
                                         r"\[0, 2, 3\]"):
        write_gguf(saved.items(), src, tmp_path / "bad.gguf", "f32")
    cfg = json.loads((src / "config.json").read_text())
    assert hparam_problems(cfg) == []
    assert any("shared_expert_intermediate_size missing" in p for p in hparam_problems(
        {**cfg, "shared_expert_intermediate_size": None}))


@pytest.mark.parametrize("change, key", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True}, "attention_bias true"),
    ({"linear_value_head_dim": 64}, "linear_key_head_dim 32 != linear_value_head_dim 64"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads 3 is not a multiple"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}, "rope_type 'yarn'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [24, 8, 8]}},
     "needs 0 < sum <= head_dim 32"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [1, 1, 0, 2]}},
     "rotary pairs [2, 3] of 4 by position 0"),
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention"]}, "layer_types ['full_attention"),
])
def test_what_llama_cpp_would_not_run_is_refused_naming_the_key(tmp_path, change, key):
    src = tmp_path / "src"
    build("qwen3.5", src)
    cfg = json.loads((src / "config.json").read_text())
    assert hparam_problems(cfg) == []
    assert any(key in p for p in hparam_problems({**cfg, **change})), hparam_problems({**cfg, **change})
    (src / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ConfigError, match=rf"train: key 'export.gguf': model {src}: llama.cpp would run another "
                                          rf"model than the one trained: .*{key[:12]}"):
        check_gguf_export(json.loads((src / "config.json").read_text()), src, "train")
    assert any("rope_scaling" in p for p in hparam_problems(cfg, {"rope_type": "linear", "factor": 2.0}))


def test_mrope_sections_that_cover_every_rotary_pair():
    """ggml's interleaved MRoPE: pair i reads section i % 3 while i < 3 x that section (i taken modulo the sum)."""
    assert unpositioned_pairs([11, 11, 10, 0], 32) == []  # the real models: 64 rotated dims of a 256 head
    assert unpositioned_pairs([11, 11, 10, 0], 4) == []  # the tiny ones: 8 rotated dims
    assert unpositioned_pairs([2, 1, 1, 0], 4) == []  # sectors 0..3: t, h, w, t
    assert unpositioned_pairs([1, 1, 1, 1], 4) == [3]  # sector 3 is the fourth position's


def test_qwen_pre_tokenizers(tmp_path):
    """The tiny model's Qwen3.5-shaped tokenizer (its hash is no real model's) is llama.cpp's `qwen35` by its split;
    the same with Qwen2's regex is `qwen2`; another split is refused."""
    qwen35_tokenizer(tmp_path / "a")
    assert choose_pre(tmp_path / "a") == "qwen35"
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX as QWEN35

    tok = json.loads((tmp_path / "a" / "tokenizer.json").read_text())
    for regex, want in ((QWEN2, "qwen2"), (QWEN35.replace("\\p{N}|", "\\p{N}{1,3}|"), None)):
        (tmp_path / "b").mkdir(exist_ok=True)
        tok["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = regex
        (tmp_path / "b" / "tokenizer.json").write_text(json.dumps(tok))
        if want is None:
            with pytest.raises(ConfigError, match="pre-tokenizer llama.cpp would know"):
                choose_pre(tmp_path / "b")
        else:
            assert choose_pre(tmp_path / "b") == want


def test_grpo_dry_run_with_export_gguf(tmp_path):
    """`tidal grpo --dry-run` with export.gguf on a tiny Qwen3.5 passes the preflight; with a config llama.cpp would
    not run (value head dim != key head dim) it exits 2 naming the model, the key and the config key."""
    src = tmp_path / "src"
    build("qwen3.5", src)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [sys.executable, "-m", "tidal.cli", "grpo", "--dry-run", "--output-dir", str(tmp_path / "r"), "--model",
            str(src), "--train.export.gguf", "f16"]
    ok = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr[-2000:]
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "linear_value_head_dim": 64}))
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "key 'export.gguf'" in r.stderr and str(src) in r.stderr, r.stderr
    assert "linear_value_head_dim 64" in r.stderr, r.stderr
