"""GGUF types on the real model in a real llama.cpp: `python bench/gguf_types.py [--types f32,f16,...] [--n 64]`
writes SmolLM2-135M-Instruct (`tidal:smollm2-135m-instruct`, dequantized float32) in each type tidal offers
(train `export.gguf`, `tidal export --gguf`), and reports per type the file size, the greedy accuracy of llama.cpp
(llama-cpp-python from `make llama-cpp`, .venv/llama-cpp or TIDAL_LLAMA_CPP) on the addition environment's fixed
eval set (64 problems, 48 new tokens, the environment's reward: as examples/real_model/greedy_eval.py), and how many
completions equal transformers' float32 greedy ones. Writes bench/GGUF.md. ~5 min on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP = Path(os.environ.get("TIDAL_LLAMA_CPP") or ROOT / ".venv" / "llama-cpp")
TYPES = "f32,f16,bf16,q8_0,q5_1,q5_0,q4_1,q4_0"
MAX_TOKENS = 48


def llama_cpp(model: Path, texts: list[str], tmp: Path) -> list[str]:
    req = tmp / "req.json"
    req.write_text(json.dumps({"texts": texts, "messages": [], "max_tokens": MAX_TOKENS}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(LLAMA_CPP), *sys.path])}
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "e2e" / "llama_cpp_chat.py"), str(model), str(req)],
                       capture_output=True, text=True, env=env, check=True)
    return [p["completion"] for p in json.loads(r.stdout.strip().splitlines()[-1])["prompts"]]


def hf_completions(base_dir: str, texts: list[str]) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    out = []
    for text in texts:
        enc = tok(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id)
        out.append(str(tok.decode(ids[0, enc.input_ids.shape[1]:], skip_special_tokens=True)))
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--n", type=int, default=64, help="eval problems (the set has 64)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "GGUF.md"))
    args = ap.parse_args(argv)
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    from tidal.envs.addition import Addition
    from tidal.models.sources import resolve_model
    from tidal.trainer.publish.gguf_out import write_gguf

    base_dir = resolve_model("tidal:smollm2-135m-instruct")
    env = Addition()
    examples = (env.eval_examples() or [])[:args.n]
    tok = AutoTokenizer.from_pretrained(base_dir)
    texts = [str(tok.apply_chat_template(e.prompt, add_generation_prompt=True, tokenize=False))  # type: ignore[arg-type]
             for e in examples]
    t0 = time.time()
    want = hf_completions(base_dir, texts)
    ref = sum(env.reward(e, c) for e, c in zip(examples, want, strict=True)) / len(examples)
    rows = [f"| transformers float32 (reference) | - | {ref:.3f} | - |"]
    weights = load_file(str(Path(base_dir) / "model.safetensors"))
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.types.split(","):
            path = write_gguf(weights.items(), Path(base_dir), Path(tmp) / f"model-{dtype}.gguf", dtype)
            got = llama_cpp(path, texts, Path(tmp))
            acc = sum(env.reward(e, c) for e, c in zip(examples, got, strict=True)) / len(examples)
            same = sum(w.strip() == c.strip() for w, c in zip(want, got, strict=True))
            rows.append(f"| {dtype} | {path.stat().st_size / 2**20:.1f} MiB | {acc:.3f} | {same}/{len(examples)} |")
            print(rows[-1], flush=True)
            path.unlink()
    text = ("# GGUF types in a real llama.cpp (bench/gguf_types.py)\n\nSmolLM2-135M-Instruct (tidal's dequantized "
            f"float32 copy), {len(examples)} addition eval problems, greedy, {MAX_TOKENS} new tokens; llama-cpp-python "
            f"0.3.36 (CPU build, `make llama-cpp`); {time.time() - t0:.0f} s.\n\n| type | file | greedy accuracy "
            "(llama.cpp) | completions equal to transformers' |\n|---|---|---|---|\n" + "\n".join(rows) + "\n")
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
