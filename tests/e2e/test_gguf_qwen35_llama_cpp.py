"""Qwen3.5 GGUF exports in a real llama.cpp (llama-cpp-python 0.3.36 built from its sdist by `make llama-cpp` into
.venv/llama-cpp, or the directory `TIDAL_LLAMA_CPP` names; skipped, naming the target, without it).

Tiny random-init Qwen3.5 text models (`tests/qwen35_tiny.py`: 3 layers linear / full / linear attention, the gated
delta-net with 2 key heads and 4 value heads, so llama.cpp's V-head reorder is needed, tied; and with 2 and 2, untied;
a Qwen3.5-shaped byte-level BPE tokenizer, llama.cpp's `qwen35` pre-tokenizer) and a tiny Qwen3.5-MoE (4 experts,
top 2, a shared expert; llama.cpp's `qwen35moe`) are written as F32 (`write_gguf` on the model's state dict: an MoE's
in-memory fused gate_up_proj) and F16 (`tidal export MODEL_DIR --gguf f16 --out ...` from the saved checkpoint, as a
run's export has its tensors: an MoE's per-expert ones). In llama.cpp (`tests/e2e/llama_cpp_greedy.py`, its own
process): the ChatML markers are single tokens with transformers' ids, each
prompt (rendered by the chat template) tokenizes to transformers' ids, and greedy completions (16 tokens, no stop)
equal transformers' float32 greedy completions of the same weights. The rule, as for Gemma
(tests/e2e/test_gguf_gemma_llama_cpp.py): F32 holds the same weights, so every completion matches and (llama.cpp with
a float32 KV cache) the last-prompt-token logits agree within 2e-3 of the largest logit; F16 rounds every matrix
(relative 2^-11), which can flip a greedy choice where two logits are nearly tied: at most one prompt may differ, and
only after its first 4 tokens. That the check sees the conventions: a file written without the V-head reorder, or
without the norms' + 1, gives other logits (> 100x the F32 gap), and so does one
without -exp(A_log).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.llama_cpp_run import MARKS, greedy_report

STEPS = 16
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
MESSAGES = [[{"role": "user", "content": "What is 12 + 30? Answer with a number."}],
            [{"role": "user", "content": "reverse the text: hello world"}],
            [{"role": "user", "content": "Sort these words: cherry, apple, banana."}],
            [{"role": "user", "content": "the lazy dog"}, {"role": "assistant", "content": "jumps over the fox"},
             {"role": "user", "content": "and then? ünïcode naïve 🦙"}]]

pytestmark = MARKS


def llama_cpp(model: Path, texts: list[str], tmp: Path, f32_cache: bool) -> dict:
    """What tests/e2e/llama_cpp_greedy.py reports for `model`."""
    return greedy_report(model, texts, SPECIALS, STEPS, tmp, f32_cache)


def hf_greedy(model, ids: list[int]) -> tuple[list[float], list[int]]:
    """(logits after the prompt, `STEPS` greedy ids) of transformers, float32, no stop, no cache (each step runs the
    whole sequence: the delta-net's chunked path, not its one-token update)."""
    import torch

    seq, out, first = list(ids), [], None
    with torch.no_grad():
        for _ in range(STEPS):
            logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
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


def gap(want: list, got: dict) -> float:
    """Largest difference between transformers' and llama.cpp's logits after each prompt."""
    return max(abs(a - b) for w, p in zip(want, got["prompts"], strict=True)
               for a, b in zip(w[0], p["logits"], strict=True))


@pytest.mark.parametrize("name", ["qwen3.5", "qwen3.5-kv-equal", "qwen3.5-moe"])
def test_tiny_qwen35_export_runs_in_llama_cpp(tmp_path, monkeypatch, name):
    import numpy as np
    from transformers import AutoTokenizer

    import tidal.trainer.publish.gguf_qwen35 as q35
    from tests.qwen35_tiny import build
    from tidal.trainer.publish.gguf_out import write_gguf

    src = tmp_path / "src"
    model = build(name, src)
    weights = model.state_dict()
    tok = AutoTokenizer.from_pretrained(src)
    f32 = write_gguf(weights.items(), src, tmp_path / "model-f32.gguf", "f32")
    f16 = tidal_export(src, tmp_path / "model-f16.gguf", "f16")
    texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in MESSAGES]
    ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
    want = [hf_greedy(model, i) for i in ids]
    vocab = tok.get_vocab()
    scale = max(abs(a) for w in want for a in w[0])
    f32_gap = 0.0
    for path, exact in ((f32, True), (f16, False)):
        got = llama_cpp(path, texts, tmp_path, f32_cache=exact)
        print(path.name, got["special"], [p["greedy"] for p in got["prompts"]], [w[1] for w in want])
        assert got["special"] == {t: [vocab[t]] for t in SPECIALS}
        assert got["n_vocab"] == model.config.vocab_size
        assert [p["ids"] for p in got["prompts"]] == ids
        differ = [(w[1], p["greedy"]) for w, p in zip(want, got["prompts"], strict=True) if w[1] != p["greedy"]]
        if exact:
            assert not differ, differ
            f32_gap = gap(want, got)
            print(f"{name} {path.name}: largest logit gap {f32_gap:.3g} of logits up to {scale:.3g}")
            assert f32_gap < 2e-3 * scale, (f32_gap, scale)
        else:
            print(f"{name} {path.name}: {len(want) - len(differ)}/{len(want)} greedy completions equal, largest "
                  f"logit gap {gap(want, got):.3g}")
            assert len(differ) <= 1 and all(w[:4] == g[:4] for w, g in differ), differ
    # the check sees the conventions: the F32 file written with one of them dropped gives other logits
    dropped = {"norms + 1": lambda k, a: a - np.float32(1.0) if k.endswith("norm.weight")
               and not k.endswith(".linear_attn.norm.weight") else a,
               "A_log as -exp(A_log)": lambda k, a: weights[k].numpy() if k.endswith(".A_log") else a}
    if model.config.linear_num_value_heads != model.config.linear_num_key_heads:
        dropped["V-head reorder"] = None
    for i, (what, undo) in enumerate(dropped.items()):
        with monkeypatch.context() as m:
            if undo is None:
                m.setattr(q35, "reorder_v_heads", lambda a, axis, n_k, per_k, dim: a)
            else:
                def tensor(key, a, cfg, undo=undo, real=q35.qwen35_tensor):
                    new, out = real(key, a, cfg)
                    return new, undo(key, out)
                m.setattr(q35, "qwen35_tensor", tensor)
            bad = write_gguf(weights.items(), src, tmp_path / f"dropped-{i}.gguf", "f32")
        wrong = gap(want, llama_cpp(bad, texts, tmp_path, f32_cache=True))
        print(f"{name} without {what}: largest logit gap {wrong:.3g}")
        assert wrong > 100 * f32_gap, (what, wrong, f32_gap)
