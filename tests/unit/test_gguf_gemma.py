"""GGUF out for the Gemma family (`tidal.trainer.publish.gguf_gemma`, the SentencePiece-style vocabulary in
`gguf_vocab`): what is written, read back with `gguf.GGUFReader`, and what is refused up front.

Models are the random-init tiny Gemma 2 / Gemma 3 of `tests/gemma_tiny.py` (Gemma-shaped tokenizer, sliding window on
the layers `layer_types` says). The real llama.cpp check is tests/e2e/test_gguf_gemma_llama_cpp.py (slow).
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

from tests.gemma_tiny import build, gemma_tokenizer  # noqa: E402
from tidal.config.load import ConfigError  # noqa: E402
from tidal.trainer.publish.gguf_out import (  # noqa: E402
    ARCHS,
    NOT_WRITTEN,
    check_gguf_export,
    gguf_out_support,
    hparam_problems,
    write_gguf,
)

ROOT = Path(__file__).resolve().parents[2]


def read(path: Path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(str(path))
    return {k: v.contents() for k, v in r.fields.items()}, {t.name: np.asarray(t.data) for t in r.tensors}


def test_gemma3_keys_tensors_and_vocabulary(tmp_path):
    """Gemma 3: per-layer sliding pattern from layer_types (not llama.cpp's default period of 6), the window, both
    RoPE bases, the global layers' linear scaling, final soft-capping; every norm weight written +1 (Gemma's
    `x * (1 + w)`), the other tensors as they are, the untied output; an SPM (`llama`) vocabulary: specials CONTROL,
    the non-special added token USER_DEFINED, `<0xXX>` BYTE, a merged token scored minus its merge rank."""
    src = tmp_path / "src"
    model = build("gemma3", src)
    state = model.state_dict()
    f, t = read(write_gguf(state.items(), src, tmp_path / "m.gguf", "f32"))
    assert f["general.architecture"] == "gemma3"
    assert f["gemma3.attention.sliding_window"] == 8
    assert list(f["gemma3.attention.sliding_window_pattern"]) == [True, False, True]
    assert f["gemma3.rope.freq_base"] == 1e6 and f["gemma3.rope.freq_base_swa"] == 1e4
    assert f["gemma3.rope.scaling.type"] == "linear" and f["gemma3.rope.scaling.factor"] == 2.0
    assert f["gemma3.final_logit_softcapping"] == 30.0 and "gemma3.attn_logit_softcapping" not in f
    assert f["gemma3.attention.key_length"] == 32
    shifted = 0
    for key, value in state.items():
        want = value.numpy() + (1.0 if key.endswith("norm.weight") else 0.0)
        name = {"lm_head.weight": "output.weight", "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight"}.get(key)
        if name is None:
            i = key.split(".")[2]
            part = key.split(".", 3)[3]
            name = f"blk.{i}." + {"self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
                                  "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
                                  "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
                                  "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
                                  "mlp.down_proj.weight": "ffn_down", "input_layernorm.weight": "attn_norm",
                                  "post_attention_layernorm.weight": "post_attention_norm",
                                  "pre_feedforward_layernorm.weight": "ffn_norm",
                                  "post_feedforward_layernorm.weight": "post_ffw_norm"}[part] + ".weight"
        np.testing.assert_array_equal(t.pop(name), want, err_msg=key)
        shifted += key.endswith("norm.weight")
    assert not t and shifted == 3 * 6 + 1  # every tensor once; 6 norms a layer and the final one
    tokens, types, scores = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"], f["tokenizer.ggml.scores"]
    ids = {tok: i for i, tok in enumerate(tokens)}
    T = gguf.TokenType
    assert f["tokenizer.ggml.model"] == "llama" and f["tokenizer.ggml.pre"] == "default"
    assert f["tokenizer.ggml.add_space_prefix"] is False and f["tokenizer.ggml.add_bos_token"] is True
    specials = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>")
    assert [types[ids[s]] for s in specials] == [T.CONTROL] * 7
    assert types[ids["<tool>"]] == T.USER_DEFINED and types[ids["<0x41>"]] == T.BYTE and scores[ids["<0x41>"]] == 0
    merges = json.loads((src / "tokenizer.json").read_text())["model"]["merges"]
    for rank in (0, len(merges) // 2, len(merges) - 1):
        merged = "".join(merges[rank])
        assert types[ids[merged]] == T.NORMAL and scores[ids[merged]] == -rank
    assert (f["tokenizer.ggml.bos_token_id"], f["tokenizer.ggml.eos_token_id"], f["tokenizer.ggml.unknown_token_id"],
            f["tokenizer.ggml.padding_token_id"]) == (2, 1, 3, 0)


def test_gemma2_soft_caps_and_tied_output(tmp_path):
    """Gemma 2: attention and final soft-capping, its alternating window as a per-layer list, one RoPE base for both
    layer kinds, the embedding as output (no `output.weight`), norms +1."""
    src = tmp_path / "src"
    model = build("gemma2", src)
    f, t = read(write_gguf(model.state_dict().items(), src, tmp_path / "m.gguf", "f16"))
    assert f["general.architecture"] == "gemma2"
    assert f["gemma2.attn_logit_softcapping"] == 50.0 and f["gemma2.final_logit_softcapping"] == 30.0
    assert list(f["gemma2.attention.sliding_window_pattern"]) == [True, False, True]
    assert f["gemma2.rope.freq_base"] == f["gemma2.rope.freq_base_swa"] == 1e4
    assert "output.weight" not in t and t["token_embd.weight"].dtype == np.float16
    np.testing.assert_array_equal(t["blk.1.post_ffw_norm.weight"],
                                  model.state_dict()["model.layers.1.post_feedforward_layernorm.weight"].numpy() + 1)


def test_gemma3_vlm_checkpoint_writes_its_text_model(tmp_path):
    """A Gemma 3 vision-language checkpoint (`Gemma3ForConditionalGeneration`, model_type gemma3): its language
    model's tensors under the text model's names, the vision tower and projector left out, hparams from
    text_config."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    src = tmp_path / "src"
    vocab = gemma_tokenizer(src)
    text = {"vocab_size": vocab, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "query_pre_attn_scalar": 32,
            "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4))
    model.save_pretrained(str(src))
    state = model.state_dict()
    assert any("vision_tower" in k for k in state)
    f, t = read(write_gguf(state.items(), src, tmp_path / "m.gguf", "f32"))
    assert f["general.architecture"] == "gemma3" and f["gemma3.block_count"] == 2
    assert list(f["gemma3.attention.sliding_window_pattern"]) == [True, False]
    assert sorted(t) == sorted(n for n in t if n.startswith(("blk.", "token_embd", "output_norm")))
    assert len(t) == 2 * 13 + 2  # 13 tensors a layer, embedding and final norm (tied: no output)
    lm = model.model.language_model.state_dict()
    np.testing.assert_array_equal(t["blk.1.attn_q.weight"], lm["layers.1.self_attn.q_proj.weight"].numpy())
    np.testing.assert_array_equal(t["output_norm.weight"], lm["norm.weight"].numpy() + 1)


BASE = {"model_type": "gemma3_text", "hidden_size": 128, "num_attention_heads": 4, "head_dim": 32,
        "num_hidden_layers": 3, "query_pre_attn_scalar": 32, "sliding_window": 8}


@pytest.mark.parametrize("change, key", [
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ({"query_pre_attn_scalar": 64}, "query_pre_attn_scalar 64"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0},
                          "sliding_attention": {"rope_type": "default"}}},
     "rope_parameters.full_attention.rope_type 'yarn'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "rope_parameters.sliding_attention.rope_type 'linear'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"model_type": "gemma2", "tie_word_embeddings": False, "attn_logit_softcapping": 50.0,
      "final_logit_softcapping": 30.0}, "tie_word_embeddings false"),
    ({"model_type": "gemma2", "final_logit_softcapping": 30.0}, "attn_logit_softcapping null"),
])
def test_what_llama_cpp_would_not_read_is_refused(change, key):
    assert any(key in p for p in hparam_problems({**BASE, **change})), hparam_problems({**BASE, **change})
    assert hparam_problems({**BASE, "model_type": "gemma3_text"}) == []


def test_query_scale_follows_llama_cpps_27b_rule():
    """llama.cpp scales Gemma 3 27B's queries (62 layers) by 1/sqrt(hidden/heads): a config saying so is written,
    the same scalar on another depth is refused."""
    big = {**BASE, "num_hidden_layers": 62, "hidden_size": 5376, "num_attention_heads": 32, "head_dim": 128,
           "query_pre_attn_scalar": 168}
    assert hparam_problems(big) == []
    assert any("query_pre_attn_scalar 168" in p for p in hparam_problems({**big, "num_hidden_layers": 60}))


def test_gemma4_global_layers_and_proportional_rope(tmp_path):
    """Gemma 4 (dense, no per-layer inputs): the global layers' head size (64) and KV heads (1) beside the sliding
    layers' (32, 2), both RoPE dimensions, proportional RoPE as `rope_freqs` (8 of 32 pairs turn: partial 0.25 of
    64), the per-layer output scale, final soft-capping; norms as they are (Gemma 4 multiplies by the weight)."""
    src = tmp_path / "src"
    model = build("gemma4", src)
    state = model.state_dict()
    f, t = read(write_gguf(state.items(), src, tmp_path / "m.gguf", "f32"))
    assert f["general.architecture"] == "gemma4"
    assert (f["gemma4.attention.key_length"], f["gemma4.attention.key_length_swa"]) == (64, 32)
    assert (f["gemma4.rope.dimension_count"], f["gemma4.rope.dimension_count_swa"]) == (64, 32)
    assert list(f["gemma4.attention.head_count_kv"]) == [2, 1, 2, 1]
    assert list(f["gemma4.attention.sliding_window_pattern"]) == [True, False, True, False]
    assert f["gemma4.embedding_length_per_layer_input"] == 0 and f["gemma4.attention.shared_kv_layers"] == 0
    assert f["gemma4.final_logit_softcapping"] == 30.0
    assert list(t["rope_freqs.weight"]) == [1.0] * 8 + [np.float32(1e30)] * 24
    np.testing.assert_array_equal(t["blk.3.layer_output_scale.weight"], np.float32([0.8]))
    np.testing.assert_array_equal(t["blk.1.attn_k_norm.weight"],
                                  state["model.layers.1.self_attn.k_norm.weight"].numpy())
    assert t["blk.1.attn_q.weight"].shape == (256, 128)


@pytest.mark.parametrize("change, key", [({"hidden_size_per_layer_input": 256}, "hidden_size_per_layer_input 256"),
                                         ({"num_kv_shared_layers": 2}, "num_kv_shared_layers 2"),
                                         ({"enable_moe_block": True}, "enable_moe_block True"),
                                         ({"attention_k_eq_v": True}, "attention_k_eq_v True")])
def test_gemma4_parts_tidal_does_not_write_are_refused(change, key):
    cfg = {**BASE, "model_type": "gemma4_text", "rope_parameters": {
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    assert hparam_problems(cfg) == []
    assert any(key in p for p in hparam_problems({**cfg, **change})), hparam_problems({**cfg, **change})


@pytest.mark.parametrize("model_type", ["qwen3_next"])
def test_architectures_llama_cpp_reads_but_tidal_does_not_write_are_refused(tmp_path, model_type):
    """Qwen3-Next is in llama.cpp 0.3.36 (llama-arch.cpp: qwen3next), but tidal does not write it (Qwen3.5 and
    Qwen3.5-MoE it does: tests/unit/test_gguf_qwen35.py): refused naming the model, the key and why."""
    assert model_type in NOT_WRITTEN and model_type not in ARCHS
    with pytest.raises(ConfigError, match=rf"train: key 'export.gguf': model {tmp_path}: model_type '{model_type}' "
                                          r"cannot be written as GGUF by tidal: llama.cpp 0.3.36 reads .*supported: "
                                          r"llama, .*gemma3_text"):
        check_gguf_export({"model_type": model_type}, tmp_path, "train")


def test_grpo_with_export_gguf_on_gemma4_e2b_shape_exits_2_before_starting(tmp_path):
    """`tidal grpo --dry-run` with export.gguf set on a model tidal cannot write (a Gemma 4 with per-layer input
    embeddings, E2B's shape) exits 2 naming the model, the key and the config key, before anything starts
    (`tidal.trainer.preflight.check_train`)."""
    from transformers import AutoModelForCausalLM, Gemma4TextConfig

    src = tmp_path / "gemma4"
    vocab = gemma_tokenizer(src)
    cfg = Gemma4TextConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=32,
                           hidden_size_per_layer_input=16, vocab_size_per_layer_input=vocab,
                           layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(src))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo", "--dry-run", "--output-dir", str(tmp_path / "r"),
                        "--model", str(src), "--train.export.gguf", "f16"], capture_output=True, text=True, env=env,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "key 'export.gguf'" in r.stderr and str(src) in r.stderr, r.stderr
    assert "hidden_size_per_layer_input 16" in r.stderr, r.stderr


def test_gemma_gguf_source_keeps_its_spelling_and_scores_without_the_file(tmp_path, monkeypatch):
    """A Gemma model that came from a GGUF file (an SPM vocabulary): the file's tokens as spelled there and its
    scores are stored at conversion and written again after the file is gone; transformers' tokenizer read from
    the file alone would give other scores (its merges keep only the file's order; here the source's scores are
    twice the merge ranks, as a file of another converter may have them)."""
    import tidal.trainer.publish.gguf_vocab as vocab
    from tidal.models.sources import resolve_model
    from tidal.trainer.publish.gguf_vocab import spm_scores, vocab_tokens

    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    model = build("gemma3-tied", src)
    with monkeypatch.context() as m:
        m.setattr(vocab, "spm_scores", lambda tok, tokens, types: [
            2 * x - 1 if t == gguf.TokenType.NORMAL else x
            for x, t in zip(spm_scores(tok, tokens, types), types, strict=True)])
        source = write_gguf(model.state_dict().items(), src, tmp_path / "g" / "s.gguf", "f32")
    f_src, _ = read(source)
    scores = list(f_src["tokenizer.ggml.scores"])
    entry = Path(resolve_model(str(source)))
    record = json.loads((entry / "gguf_tokenizer.json").read_text())
    assert record["model"] == "llama" and record["scores"] == scores
    assert record["tokens"] == list(f_src["tokenizer.ggml.tokens"])
    source.unlink()
    # transformers 5.19 reads no query_pre_attn_scalar from a gemma3 GGUF (its default: 256; llama.cpp scales by
    # 1/sqrt(head_dim) = 1/sqrt(32)): the export refuses that, rightly; this test is about the tokenizer
    config = json.loads((entry / "config.json").read_text())
    assert config["query_pre_attn_scalar"] == 256
    (entry / "config.json").write_text(json.dumps({**config, "query_pre_attn_scalar": 32}))
    tok = json.loads((entry / "tokenizer.json").read_text())
    tokens, types = vocab_tokens(tok, len(scores), spm=True)
    assert spm_scores(tok, tokens, record["token_types"]) != scores  # what the export would write without the record
    f, _ = read(write_gguf(model.state_dict().items(), entry, tmp_path / "again.gguf", "f16"))
    assert list(f["tokenizer.ggml.scores"]) == scores
    assert list(f["tokenizer.ggml.tokens"]) == record["tokens"]
    assert list(f["tokenizer.ggml.token_type"]) == list(f_src["tokenizer.ggml.token_type"])


def test_family_table_cell():
    """`gguf_out_support`, what docs/models.md's family table shows: llama.cpp's architecture, a VLM's text model,
    or why not."""
    assert gguf_out_support("gemma3_text") == (True, "gemma3")
    assert gguf_out_support("gemma3") == (True, "gemma3 (text model)")
    assert gguf_out_support("mistral") == (True, "llama")
    assert gguf_out_support("qwen3_5") == (True, "qwen35 (text model)")
    assert gguf_out_support("qwen3_5_moe") == (True, "qwen35moe (text model)")
    written, why = gguf_out_support("qwen3_next")
    assert not written and "in_proj_qkvz" in why
    assert gguf_out_support("gpt2")[0] is False
