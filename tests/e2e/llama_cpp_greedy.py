"""Run by tests/e2e/test_gguf_gemma_llama_cpp.py with llama-cpp-python on PYTHONPATH (`make llama-cpp`): `python
tests/e2e/llama_cpp_greedy.py MODEL.gguf REQUEST.json` loads the GGUF in a real llama.cpp and prints JSON: how each
of the request's `specials` tokenizes (special=True), the vocabulary size, and for each prompt text its llama.cpp
token ids (no BOS added: the texts carry theirs), the logits after the whole prompt, and the ids of `max_tokens`
greedy steps from it (no stop at end-of-generation tokens, so a random model's completions compare token by token).
With `f32_cache` the KV cache holds float32 (llama.cpp's default is F16, which rounds K and V). In its own process: a
crash of the C++ library cannot take the test run with it.
"""

from __future__ import annotations

import json
import sys


def main(model: str, request: str) -> int:
    import numpy as np
    from llama_cpp import Llama

    req = json.loads(open(request).read())
    kv = 0 if req.get("f32_cache") else None  # GGML_TYPE_F32; llama.cpp's default KV cache is F16
    llm = Llama(model_path=model, n_ctx=512, n_threads=req.get("threads", 2), seed=0, verbose=False, type_k=kv,
                type_v=kv)
    out: dict = {"special": {t: llm.tokenize(t.encode(), add_bos=False, special=True) for t in req["specials"]},
                 "n_vocab": llm.n_vocab(), "prompts": []}
    for text in req["texts"]:
        ids = llm.tokenize(text.encode(), add_bos=False, special=True)
        llm.reset()
        llm.eval(ids)  # one batch (< n_batch tokens): the context holds the last token's logits
        logits = [float(x) for x in np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))]
        llm.reset()
        greedy = []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            greedy.append(int(tok))
            if len(greedy) == req["max_tokens"]:
                break
        out["prompts"].append({"ids": ids, "logits": logits, "greedy": greedy})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
