"""Run by tests/e2e/test_gguf_llama_cpp.py (and bench/gguf_types.py) with llama-cpp-python on PYTHONPATH (`make
llama-cpp`): `python tests/e2e/llama_cpp_chat.py MODEL.gguf REQUEST.json` loads the GGUF in a real llama.cpp and
prints JSON: how `<|im_start|>` / `<|im_end|>` tokenize (special=True), and for each prompt text (rendered by the HF
chat template) its llama.cpp token ids and the greedy completion from those ids, plus the greedy completion of
llama.cpp's own chat path (the chat template inside the GGUF) for each message list. In its own process: a crash of
the C++ library cannot take the test run with it.
"""

from __future__ import annotations

import json
import sys


def main(model: str, request: str) -> int:
    from llama_cpp import Llama

    req = json.loads(open(request).read())
    llm = Llama(model_path=model, n_ctx=512, n_threads=req.get("threads", 2), seed=0, verbose=False)
    greedy = {"temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0,
              "max_tokens": req["max_tokens"]}
    out: dict = {"special": {t: llm.tokenize(t.encode(), add_bos=False, special=True)
                             for t in ("<|im_start|>", "<|im_end|>")},
                 "n_vocab": llm.n_vocab(), "prompts": [], "chat": []}
    for text in req["texts"]:
        ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        done = llm.create_completion(prompt=ids, **greedy)
        out["prompts"].append({"ids": ids, "completion": done["choices"][0]["text"]})
        llm.reset()
    for messages in req["messages"]:
        done = llm.create_chat_completion(messages=messages, **greedy)
        out["chat"].append(done["choices"][0]["message"]["content"])
        llm.reset()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
