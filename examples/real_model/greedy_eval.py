"""Greedy accuracy of SmolLM2-135M-Instruct on the addition environment's fixed evaluation set with transformers'
`generate`: the cross-check of `tidal eval` (which `make run-real` and bench/learn.py use: vLLM, ~16x faster here).
`python examples/real_model/greedy_eval.py [--limit N] [RUN_DIR | ADAPTER_DIR ...]` prints (JSON) the base model's
accuracy and that of each trained adapter (`RUN_DIR/final/adapter`, or a PEFT adapter directory such as
bench/learn.py's TRL runs leave) on the first N problems (default: all 256), with the per-problem rewards.
transformers, batched greedy decoding (left padding), 48 new tokens, the environment's own reward
(`tidal.envs.addition`); ~1 min per 64 problems and model on 2 CPU cores.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tidal.envs.addition import Addition
from tidal.models.sources import resolve_model

MODEL = "tidal:smollm2-135m-instruct"


def accuracy(model, tok, env: Addition, max_new_tokens: int = 48, batch: int = 32, limit: int | None = None
             ) -> tuple[float, list[float]]:
    """Mean reward of greedy completions over the first `limit` of `env.eval_examples()`, and each reward."""
    examples = (env.eval_examples() or [])[:limit]
    tok.padding_side = "left"
    rewards: list[float] = []
    for i in range(0, len(examples), batch):
        part = examples[i:i + batch]
        texts = [tok.apply_chat_template(e.prompt, add_generation_prompt=True, tokenize=False) for e in part]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        for e, row in zip(part, out[:, enc.input_ids.shape[1]:], strict=True):
            rewards.append(env.reward(e, tok.decode(row, skip_special_tokens=True)))
    return sum(rewards) / len(examples), rewards


def main(argv: list[str]) -> int:
    limit = None
    if argv[:1] == ["--limit"]:
        limit, argv = int(argv[1]), argv[2:]
    torch.manual_seed(0)
    path = resolve_model(MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    env = Addition()
    t = time.time()
    per: dict[str, list[float]] = {}
    result: dict[str, object] = {}
    result["base"], per["base"] = accuracy(model, tok, env, limit=limit)
    for arg in argv:
        from peft import PeftModel

        adapter = Path(arg) if (Path(arg) / "adapter_config.json").is_file() else Path(arg) / "final" / "adapter"
        trained = PeftModel.from_pretrained(model, str(adapter)).eval()
        result[arg], per[arg] = accuracy(trained, tok, env, limit=limit)
        model = trained.unload()  # the base model again for the next adapter
    result["n"] = len(per["base"])
    result["rewards"] = per
    result["seconds"] = round(time.time() - t, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
