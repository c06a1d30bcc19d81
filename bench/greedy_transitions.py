"""Which problems a trained adapter fixed and broke: greedy completions of the base model and of each adapter on the
`addition` env's fixed eval set (prompt_format text, A, B in [0, 19], 128 problems), scored by the env's own reward.

A diagnosis aid for bench/LEARN-GEMMA-EXPLORED.md, not the bench's measurement (that is `tidal eval`): it runs in
transformers + PEFT, so it needs no vLLM and no lock, and it reads adapters `tidal eval` cannot reach, such as a run's
`broadcasts/step_N` when the run stopped before its final adapter. Where both ran they agree (base 0.367; the lr 5e-4
adapters 0.070 and 0.078). Simplifications: one batch, left padding, float32, CPU.

    python bench/greedy_transitions.py --max-tokens 4 RUN/broadcasts/step_18 [ADAPTER ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("adapters", nargs="*", help="PEFT adapter directories")
    p.add_argument("--model", default="tidal:gemma3-270m")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--eval-size", type=int, default=128)
    args = p.parse_args()
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidal.envs.addition import Addition
    from tidal.models.sources import resolve_model

    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    env = Addition(low=0, high=19, eval_size=args.eval_size, prompt_format="text")
    examples = env.eval_examples() or []
    enc = tok([e.prompt for e in examples], return_tensors="pt", padding=True)  # BOS first: the entry's tokenizer

    def greedy(model: Any) -> tuple[list[str], list[float]]:  # a transformers or PEFT causal LM
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=args.max_tokens, do_sample=False)  # (N, prompt + new)
        texts = tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
        return texts, [env.reward(e, c) for e, c in zip(examples, texts, strict=True)]

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    base_text, base_r = greedy(model)
    print(f"base: greedy {sum(base_r) / len(base_r):.3f} {base_text[:3]}", flush=True)
    for adapter in args.adapters:
        peft = PeftModel.from_pretrained(model, adapter)
        text, r = greedy(peft)
        fixed = sum(a == 0 and b == 1 for a, b in zip(base_r, r, strict=True))
        broke = sum(a == 1 and b == 0 for a, b in zip(base_r, r, strict=True))
        changed = sum(a != b for a, b in zip(base_text, text, strict=True))
        print(f"{adapter}: greedy {sum(r) / len(r):.3f}, fixed {fixed}, broke {broke}, changed {changed} of "
              f"{len(r)} {text[:3]}", flush=True)
        model = peft.unload()


if __name__ == "__main__":
    main()
