"""GGUF out as llama.cpp reads it (`tidal.trainer.publish.gguf_out`, `gguf_vocab`, `export`, `export_cmd`): token
types and pre-tokenizer, RoPE scaling and refusals, the quantized types, the export order and `tidal export`.

Every model is built here from a config (random init) with a byte-level BPE tokenizer trained on a few sentences
(`tokenizers`, no download) shaped like SmolLM2's: the chat markers are special added tokens that are also in the
BPE vocabulary (ids 1 and 2), digits split one by one before GPT-2's byte-level regex. Files are read back with
`gguf.GGUFReader` (and transformers + gguf where logits are compared, in float64). The real llama.cpp check is
tests/e2e/test_gguf_llama_cpp.py (slow; `make llama-cpp`).
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

from tidal.config.load import ConfigError  # noqa: E402
from tidal.config.train import ExportSection  # noqa: E402
from tidal.trainer.publish.export import GGUFExportError, export_final  # noqa: E402
from tidal.trainer.publish.gguf_out import check_gguf_export, hparam_problems, write_gguf  # noqa: E402
from tidal.trainer.publish.gguf_vocab import choose_pre  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ROOT = Path(__file__).resolve().parents[2]


def smol_tokenizer(out: Path, digits: bool = True, custom_split: bool = False) -> int:
    """A SmolLM2-shaped byte-level BPE tokenizer in `out` (vocabulary ~300); its size. `<tool>` is a non-special
    added token."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if custom_split:  # a pre-tokenizer llama.cpp has no id for: split on commas, then bytes without GPT-2's regex
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(","), "isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=False)])
    elif digits:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["What is 12 + 30? Answer with a number.", "the quick brown fox jumps over the lazy dog",
                             "reverse the text: hello world"] * 20, trainer)
    tok.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(out))
    return int(tok.get_vocab_size())


def tiny_llama(out: Path, tied: bool = True, **config):
    """A random-init tiny Llama (widths multiples of 32) with `smol_tokenizer`, saved as an HF directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = smol_tokenizer(out, **{k: config.pop(k) for k in ("digits", "custom_split") if k in config})
    config.setdefault("max_position_embeddings", 256)
    cfg = AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied, bos_token_id=1,
                               eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-5, **config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    model.save_pretrained(str(out))
    return model


def fields(path: Path) -> dict:
    return {k: v.contents() for k, v in gguf.GGUFReader(str(path)).fields.items()}


def test_chat_markers_are_control_tokens(tmp_path):
    """The chat markers are special added tokens that are also in the BPE vocabulary: written CONTROL (llama.cpp
    then matches `<|im_start|>` in text as one token), a non-special added token USER_DEFINED, the rest NORMAL; the
    pre-tokenizer id is `smollm` (single digits, then GPT-2's regex), add_bos/add_eos as the tokenizer does."""
    src = tmp_path / "src"
    model = tiny_llama(src)
    tok = json.loads((src / "tokenizer.json").read_text())
    assert {"<|im_start|>", "<|im_end|>"} <= set(tok["model"]["vocab"])  # in both, as in SmolLM2
    out = write_gguf(model.state_dict().items(), src, tmp_path / "m.gguf", "f32")
    f = fields(out)
    tokens, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"]
    ids = {t: i for i, t in enumerate(tokens)}
    T = gguf.TokenType
    assert [types[ids[t]] for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [T.CONTROL] * 3
    assert types[ids["<tool>"]] == T.USER_DEFINED
    assert types[ids["the"]] == T.NORMAL and sum(t == T.NORMAL for t in types) == len(tokens) - 4
    assert f["tokenizer.ggml.pre"] == "smollm"
    assert f["tokenizer.ggml.add_bos_token"] is False and f["tokenizer.ggml.add_eos_token"] is False
    assert f["tokenizer.ggml.bos_token_id"] == 1 and f["tokenizer.ggml.eos_token_id"] == 2


def test_pre_tokenizer_by_identity_or_refused(tmp_path):
    """GPT-2's byte-level split alone is llama.cpp's `gpt-2`; a pre-tokenizer no family has is refused up front
    (exit 2 before training) naming the check hash and the families tidal knows."""
    plain, odd = tmp_path / "plain", tmp_path / "odd"
    smol_tokenizer(plain, digits=False)
    assert choose_pre(plain) == "gpt-2"
    smol_tokenizer(odd, custom_split=True)
    cfg = {"model_type": "llama", "hidden_act": "silu"}
    with pytest.raises(ConfigError, match=r"train: key 'export.gguf'.*check hash [0-9a-f]{16}.*Llama 3 \(llama-bpe\)"
                                          r".*Qwen3 \(qwen2\).*SmolLM / SmolLM2 \(smollm\)"):
        check_gguf_export(cfg, odd, "train")


@pytest.mark.parametrize("rope, written", [
    ({"rope_type": "linear", "factor": 2.0}, {"type": "linear", "factor": 2.0}),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
     {"type": "yarn", "factor": 4.0, "original_context_length": 64}),
])
def test_rope_scaling_is_written(tmp_path, rope, written):
    src = tmp_path / "src"
    model = tiny_llama(src, rope_parameters={"rope_theta": 5e5, **rope})
    f = fields(write_gguf(model.state_dict().items(), src, tmp_path / "m.gguf", "f32"))
    got = {k.removeprefix("llama.rope.scaling."): v for k, v in f.items() if k.startswith("llama.rope.scaling.")}
    assert got == written and f["llama.rope.freq_base"] == 5e5


def test_llama3_rope_writes_the_frequency_factors_transformers_uses(tmp_path):
    """`rope_type: llama3`: the `rope_freqs` tensor holds, per rotary frequency, base inv_freq / llama3 inv_freq as
    transformers computes them (its own rope init function, float64)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    src = tmp_path / "src"
    model = tiny_llama(src, rope_parameters=rope)
    out = write_gguf(model.state_dict().items(), src, tmp_path / "m.gguf", "f32")
    got = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(out)).tensors}["rope_freqs.weight"]
    cfg = AutoConfig.from_pretrained(str(src))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    base = 1.0 / (5e5 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    want = (base / scaled.double()).numpy()
    assert want.min() == pytest.approx(1.0) and want.max() == pytest.approx(8.0)  # both ends and a blend between
    assert ((want > 1.0 + 1e-6) & (want < 8.0 - 1e-6)).any()
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-6)
    assert "llama.rope.scaling.type" not in fields(out)  # llama.cpp reads llama3 from rope_freqs alone


@pytest.mark.parametrize("cfg, key", [
    ({"model_type": "llama", "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    ({"model_type": "qwen3", "rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_type 'llama3' on qwen3"),
    ({"model_type": "qwen2", "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                              "beta_fast": 16}}, "rope_parameters.beta_fast 16"),
    ({"model_type": "mistral", "sliding_window": 64, "max_position_embeddings": 256}, "sliding_window 64"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64}, "use_sliding_window"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_what_llama_cpp_would_not_read_is_refused(cfg, key):
    assert any(key in p for p in hparam_problems(cfg)), hparam_problems(cfg)


def test_train_rope_scaling_is_exported_and_checked(tmp_path):
    """train `rope_scaling` (applied in training) goes into the file, and an unwritable one is refused up front."""
    src = tmp_path / "src"
    model = tiny_llama(src)
    f = fields(write_gguf(model.state_dict().items(), src, tmp_path / "m.gguf", "f32",
                          {"rope_type": "linear", "factor": 3.0}))
    assert f["llama.rope.scaling.type"] == "linear" and f["llama.rope.scaling.factor"] == 3.0
    cfg = json.loads((src / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"key 'export.gguf'.*rope_type 'longrope'"):
        check_gguf_export(cfg, src, "train", {"rope_type": "longrope"})


BLOCK_BOUND = {  # the largest |error| of one value, as a fraction of its block's max |x| (q*_0) or range (q*_1)
    "q8_0": 1 / 254, "q5_0": 1 / 16, "q4_0": 1 / 8, "q5_1": 1 / 62, "q4_1": 1 / 30}
"""Round-to-nearest on the block's scale d: |err| <= d/2, with d = amax/127 (q8_0), amax/16 (q5_0) or amax/8 (q4_0;
the clipped top level costs up to one d), (max - min)/31 (q5_1) or /15 (q4_1); plus the float16 rounding of d."""


@pytest.mark.parametrize("dtype", ["q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "bf16", "f16"])
def test_quantized_types_read_back_within_their_error(tmp_path, dtype):
    """Each matrix in the type asked for (the embedding Q8_0 under 4/5 bits), norms F32; dequantized by gguf, every
    32-value block is within its type's rounding bound of the float64 source (q/k rows in llama.cpp's order), and
    not exact (the type was applied)."""
    from gguf.quants import dequantize

    from tidal.trainer.publish.gguf_out import rope_interleave

    src = tmp_path / "src"
    model = tiny_llama(src, tied=False)
    out = write_gguf(model.state_dict().items(), src, tmp_path / "m.gguf", dtype)
    tensors = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    big = "Q8_0" if dtype.startswith(("q4", "q5")) else dtype.upper()
    assert tensors["token_embd.weight"].tensor_type.name == big == tensors["output.weight"].tensor_type.name
    assert tensors["blk.1.ffn_down.weight"].tensor_type.name == dtype.upper()
    sd = model.state_dict()
    for name, key, heads in (("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight", 0),
                             ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", 4),
                             ("token_embd.weight", "model.embed_tokens.weight", 0)):
        t = tensors[name]
        got = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64).reshape(-1, 32)
        w = sd[key].double().numpy()
        want = (rope_interleave(w, heads) if heads else w).reshape(-1, 32)
        err = np.abs(got - want).max(axis=1)
        kind = t.tensor_type.name.lower()
        if kind in BLOCK_BOUND:
            scale = np.abs(want).max(axis=1) if kind.endswith("_0") else np.ptp(want, axis=1)
            bound = scale * (BLOCK_BOUND[kind] * (1 + 2 ** -9)) + np.abs(want).max(axis=1) * 2 ** -10
        else:  # f16 / bf16: round to nearest in 11 / 8 significant bits
            bound = np.abs(want).max(axis=1) * (2 ** -11 if kind == "f16" else 2 ** -8)
        assert (err <= bound).all(), (name, float((err / bound).max()))
        assert err.max() > 0, name


def test_export_writes_the_adapter_first_and_a_gguf_failure_costs_nothing(tmp_path):
    """The GGUF step fails for real (the base model's tokenizer.json went missing after training): final/adapter is
    complete, nothing of final/gguf exists, and the error is one line naming `tidal export`; with the GGUF the only
    thing asked for, the adapter is kept instead of nothing. Then `tidal export RUN_DIR` writes the file (exit 0)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, run = tmp_path / "src", tmp_path / "run"
    tiny_llama(src)
    base = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)  # as the trainer loads it
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    tok = AutoTokenizer.from_pretrained(str(src))
    (src / "tokenizer.json").rename(tmp_path / "tokenizer.json")
    for export in (ExportSection(adapter=True, gguf="f16"), ExportSection(adapter=False, gguf="q8_0")):
        with pytest.raises(GGUFExportError) as info:
            export_final(model, tok, export, str(src), run)
        msg = str(info.value)
        assert "\n" not in msg and f"tidal export {run} --gguf {export.gguf}" in msg and "tokenizer.json" in msg
        assert (run / "final" / "adapter" / "STABLE").is_file()
        assert sorted(p.name for p in (run / "final").iterdir()) == ["adapter"]  # no gguf, no temp directory
    (tmp_path / "tokenizer.json").rename(src / "tokenizer.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-m", "tidal.cli", "export", str(run), "--gguf", "f32"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    path = run / "final" / "gguf" / "model-f32.gguf"
    assert r.stdout.strip() == str(path) and (path.parent / "STABLE").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ids = torch.randint(0, base.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model.double()(ids).logits
        got = loaded.double()(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)  # merged in float32, compared in float64


def tidal_export(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "tidal.cli", "export", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_tidal_export_refuses_bad_input_with_exit_2(tmp_path):
    src = tmp_path / "src"
    tiny_llama(src)
    r = tidal_export(str(src), "--gguf", "q3_k", "--out", str(tmp_path / "m.gguf"))
    assert r.returncode == 2 and "--gguf q3_k" in r.stderr and "q4_0" in r.stderr, r.stderr
    r = tidal_export(str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "no such directory" in r.stderr, r.stderr
    r = tidal_export(str(src))
    assert r.returncode == 2 and "--out FILE" in r.stderr, r.stderr
    (tmp_path / "run" / "final").mkdir(parents=True)
    r = tidal_export(str(tmp_path / "run"))
    assert r.returncode == 2 and "did not finish" in r.stderr, r.stderr
    r = tidal_export(str(src), "--out", str(tmp_path / "m.gguf"), "--gguf", "q4_0")  # a model directory: written
    assert r.returncode == 0, r.stderr
    assert gguf.GGUFReader(str(tmp_path / "m.gguf")).fields["general.file_type"].contents() == \
        gguf.LlamaFileType.MOSTLY_Q4_0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "run", "src"]  # no temporary file left


def test_missing_gguf_package_exits_2_before_training(tmp_path):
    """`import gguf` failing (a shadowing package that raises ImportError) is refused by the preflight: `tidal grpo
    --dry-run` with export.gguf exits 2 naming the package, before anything starts."""
    src, shadow = tmp_path / "src", tmp_path / "shadow" / "gguf"
    tiny_llama(src, max_position_embeddings=4096)
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('gguf hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow.parent), *sys.path])}
    r = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo", "--dry-run", "--output-dir", str(tmp_path / "r"),
                        "--model", str(src), "--train.export.gguf", "f16"], capture_output=True, text=True, env=env,
                       timeout=180, cwd=ROOT)
    assert r.returncode == 2 and "key 'export.gguf'" in r.stderr and "`gguf` package" in r.stderr, r.stderr


def test_gguf_source_keeps_its_token_types_and_pre_without_the_file(tmp_path, monkeypatch):
    """A model that came from a GGUF file: its token types and `tokenizer.ggml.pre` are stored at conversion
    (gguf_tokenizer.json in the cache entry), and an export after the source file is gone writes them as the
    source had them, even where they differ from what the tokenizer alone would give."""
    from tidal.models.sources import resolve_model

    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    model = tiny_llama(src)
    n = int(model.config.vocab_size)
    types = [int(gguf.TokenType.NORMAL)] * n
    types[5] = int(gguf.TokenType.USER_DEFINED)  # a source typing of its own
    (src / "gguf_tokenizer.json").write_text(json.dumps({"pre": "qwen2", "token_types": types}))
    source = write_gguf(model.state_dict().items(), src, tmp_path / "g" / "s.gguf", "f32")
    entry = Path(resolve_model(str(source)))
    record = json.loads((entry / "gguf_tokenizer.json").read_text())
    assert record["pre"] == "qwen2" and record["token_types"] == types
    source.unlink()
    out = write_gguf(model.state_dict().items(), entry, tmp_path / "again.gguf", "f16")
    f = fields(out)
    assert f["tokenizer.ggml.pre"] == "qwen2" and list(f["tokenizer.ggml.token_type"]) == types


def test_tidal_export_of_a_bf16_directory_reads_back_as_its_weights(tmp_path):
    """Issue 66: a bfloat16 model directory (every GPU run's final/merged, most Hub directories) exported to an f32
    GGUF exits 0, and every tensor reads back equal to the bf16 weights cast to float32 (q/k in llama.cpp's row
    order). Before, `safetensors.numpy` could not read bfloat16: a TypeError traceback, exit 1."""
    from gguf.quants import dequantize
    from safetensors.torch import load_file

    from tidal.trainer.publish.gguf_out import rope_interleave

    src = tmp_path / "src"
    tiny_llama(src, tied=False).to(torch.bfloat16).save_pretrained(str(src))
    sd = load_file(str(src / "model.safetensors"))
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}
    r = tidal_export(str(src), "--gguf", "f32", "--out", str(tmp_path / "m.gguf"))
    assert r.returncode == 0, r.stderr
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    pairs = {"token_embd.weight": ("model.embed_tokens.weight", 0), "output.weight": ("lm_head.weight", 0),
             "output_norm.weight": ("model.norm.weight", 0)}
    for i in range(2):
        pairs |= {f"blk.{i}.attn_q.weight": (f"model.layers.{i}.self_attn.q_proj.weight", 4),
                  f"blk.{i}.attn_k.weight": (f"model.layers.{i}.self_attn.k_proj.weight", 2),
                  f"blk.{i}.attn_v.weight": (f"model.layers.{i}.self_attn.v_proj.weight", 0),
                  f"blk.{i}.ffn_down.weight": (f"model.layers.{i}.mlp.down_proj.weight", 0),
                  f"blk.{i}.attn_norm.weight": (f"model.layers.{i}.input_layernorm.weight", 0)}
    for name, (key, heads) in pairs.items():
        t = tensors[name]
        assert t.tensor_type.name == "F32", name
        got = dequantize(np.asarray(t.data), t.tensor_type).reshape(sd[key].shape)
        want = sd[key].float().numpy()
        want = rope_interleave(want, heads) if heads else want
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_a_second_gguf_type_keeps_the_first(tmp_path):
    """Issue 66: `tidal export RUN_DIR --gguf q8_0` after an f16 export keeps `model-f16.gguf` (final/gguf/ was
    replaced whole, deleting it); exporting the same type again replaces that file only."""
    from tidal.trainer.publish.export import write_final_gguf

    src, run = tmp_path / "src", tmp_path / "run"
    model = tiny_llama(src)
    weights = dict(model.state_dict())
    first = write_final_gguf(weights, src, run, "f16")
    before = first.read_bytes()
    second = write_final_gguf(weights, src, run, "q8_0")
    gguf_dir = run / "final" / "gguf"
    assert sorted(p.name for p in gguf_dir.iterdir()) == ["STABLE", "model-f16.gguf", "model-q8_0.gguf"]
    assert first.read_bytes() == before and second.stat().st_size < len(before)
    assert gguf.GGUFReader(str(first)).fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_F16
    write_final_gguf(weights, src, run, "q8_0")
    assert sorted(p.name for p in gguf_dir.iterdir()) == ["STABLE", "model-f16.gguf", "model-q8_0.gguf"]
    assert sorted(p.name for p in (run / "final").iterdir()) == ["gguf"]  # no temporary directory left


def test_tidal_export_base_for_a_model_directory_is_refused(tmp_path):
    """Issue 66: `--base` names the base an adapter merges into; for a model directory it was accepted and
    ignored. Now exit 2 naming the flag, nothing written."""
    src = tmp_path / "src"
    tiny_llama(src)
    r = tidal_export(str(src), "--base", str(src), "--out", str(tmp_path / "m.gguf"))
    assert r.returncode == 2 and "--base" in r.stderr and "adapter" in r.stderr, r.stderr
    assert not (tmp_path / "m.gguf").exists()
