"""TRL's GRPOTrainer on the same job as tidal's bench run: one process, transformers generation, LoRA.

Run by `bench/run_bench.py` (reverse-text, the bundled model) and `bench/learn.py` (`--env addition`, the real
model) in its own process; writes a JSON file with the wall-clock time (`elapsed_s` from the script's start, and
`wall` as epoch seconds) and mean reward of every optimizer step (one step = `prompts x generations` completions, as
in tidal); `--save-adapter DIR` keeps the final LoRA adapter (for bench/learn.py's greedy evaluation).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                    help="bf16: GRPOConfig(bf16=True), autocast on CPU (the model stays float32 there)")
    ap.add_argument("--env", default="reverse-text", choices=["reverse-text", "addition"])
    ap.add_argument("--env-args", default="{}",
                    help="the environment's arguments, JSON (tidal's env `args`: e.g. addition's prompt_format text, "
                         "low, high for bench/learn_gemma.py's base-model task)")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (GRPOConfig's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-alpha", type=int, default=32)
    ap.add_argument("--save-adapter", default=None)
    ap.add_argument("--gradient-checkpointing", choices=["on", "off"], default="on",
                    help="TRL's GRPOConfig gradient_checkpointing (TRL 1.16's default: on)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    script_start = time.monotonic()

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tidal.envs import make_env
    from tidal.envs.reverse_text import extract_answer, similarity

    env = make_env(args.env, json.loads(args.env_args))
    rng = random.Random(args.seed)
    rows = [env.sample(rng) for _ in range(args.prompts * (args.steps + 2))]
    data = Dataset.from_list([{"prompt": ex.prompt, "answer": ex.answer} for ex in rows])

    def text(completion) -> str:  # conversational prompts give message lists, plain-text prompts strings
        return completion if isinstance(completion, str) else completion[0]["content"]

    def reverse_reward(completions, answer, **kwargs):
        if args.env == "addition":
            return [env.reward(ex, text(c)) for c, ex in zip(completions, example_of(answer), strict=True)]
        return [similarity(extract_answer(text(c)), a) for c, a in zip(completions, answer, strict=True)]

    def example_of(answers):
        from tidal.envs.base import Example

        return [Example(prompt=[], answer=a) for a in answers]

    per_device = args.prompts * args.generations // 4
    cfg = GRPOConfig(output_dir=str(Path(args.out).parent / "trl_out"), max_steps=args.steps,
                     per_device_train_batch_size=per_device, gradient_accumulation_steps=4,
                     num_generations=args.generations, max_completion_length=args.max_tokens,
                     temperature=args.temperature,
                     learning_rate=args.lr, lr_scheduler_type="constant", logging_steps=1, report_to=[],
                     save_strategy="no", use_cpu=args.device == "cpu",
                     bf16=args.device != "cpu" or args.precision == "bf16",
                     loss_type="dapo", beta=0.0, seed=args.seed, shuffle_dataset=False, disable_tqdm=True,
                     gradient_checkpointing=args.gradient_checkpointing == "on")
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(args.model)
    lora = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    steps: list[dict[str, float]] = []
    start = time.monotonic()

    class Timer(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                steps.append({"step": state.global_step, "elapsed_s": time.monotonic() - start,
                              "since_script_s": time.monotonic() - script_start, "wall": time.time(),
                              "reward": float(logs["reward"])})

    trainer = GRPOTrainer(model=model, reward_funcs=reverse_reward, args=cfg, train_dataset=data,
                          processing_class=tok, peft_config=lora, callbacks=[Timer()])
    start = time.monotonic()
    trainer.train()
    total = time.monotonic() - start
    if args.save_adapter:
        trainer.model.save_pretrained(args.save_adapter)
    Path(args.out).write_text(json.dumps({"steps": steps, "total_s": total}))


if __name__ == "__main__":
    main()
