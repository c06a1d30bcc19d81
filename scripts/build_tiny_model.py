"""Build the bundled tiny model `src/tidal/assets/tiny-reverse/` from scratch, reproducibly.

1. A character-level tokenizer (printable ASCII + newline, the chat special tokens `<|im_start|>`,
   `<|im_end|>`, `<|endoftext|>`, and the answer tags `<reversed_text>` / `</reversed_text>` as single
   tokens), with a ChatML chat template.
2. A randomly initialized Qwen3-architecture model: 4 layers, hidden 256, 8 heads of dim 32 (4 KV heads),
   MLP 768, tied embeddings: about 3.2M parameters, stored in float32 (~13 MB).
3. A warm start with `tidal sft` on generated reverse-text examples with label smoothing 0.5: the first
   snapshot (every 50 steps) whose greedy answers reach a mean reward of 0.9 is kept. The smoothed targets
   leave its temperature-1 samples noisy (mean reward ~0.4-0.6): the model can reverse but is far from
   reliable, which is the room GRPO has to show progress within a few minutes.
4. Calibration: smoothing 0.5 leaves samples near chance (~0.25), so the final RMSNorm weight (with tied
   embeddings: every logit) is scaled by the factor, found by bisection, at which temperature-1 samples
   score about 0.4. (Without smoothing, greedy
   and sampled rewards stay within ~0.07 of each other and a short GRPO run gains little, see the note of
   the first release.)

Run: `.venv/bin/python scripts/build_tiny_model.py [--out DIR] [--sft-steps N]` (about 12-15 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import shutil
import string
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "src" / "tidal" / "assets" / "tiny-reverse"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
TAGS = ["<reversed_text>", "</reversed_text>"]
VOCAB_SIZE = 128  # padded with unused special tokens so every id decodes
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    tokens = SPECIALS + TAGS + chars
    tokens += [f"<|unused_{i}|>" for i in range(VOCAB_SIZE - len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    unused = [t for t in tokens if t.startswith("<|unused_")]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS + unused])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", bos_token=None, model_max_length=1024)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def build_model(out: Path, seed: int) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(out))
    keys: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        torch_dtype="float32")
    cfg = Qwen3Config(**keys)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)


def warm_start(model_dir: Path, steps: int, every: int, seed: int, sft_dir: Path, smoothing: float) -> None:
    """`tidal sft` on reverse-text: full weights, constant LR, a snapshot every `every` steps in `sft_dir`."""
    cmd = [sys.executable, "-m", "tidal.cli", "sft", "--train.model", str(model_dir),
           "--train.lora", "false", "--train.max_steps", str(steps), "--train.learning_rate", "2e-3",
           "--train.warmup_steps", "10", "--train.lr_scheduler_type", "constant", "--train.seed", str(seed),
           "--train.sequence_len", "512", "--train.per_device_train_batch_size", "4", "--train.logging_steps",
           "10", "--sft.examples_per_step", "32", "--sft.save_to", str(sft_dir), "--sft.save_every", str(every),
           "--sft.label_smoothing", str(smoothing)]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


def evaluate(model_dir: Path, num_prompts: int = 64, seed: int = 1234, greedy: bool = False) -> float:
    """Mean reverse-text reward of temperature-1 (or greedy) samples via transformers generate."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidal.envs import make_env

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    env, rng = make_env("reverse-text"), random.Random(seed)
    examples = [env.sample(rng) for _ in range(num_prompts)]
    prompts: list[Any] = [e.prompt for e in examples]
    texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0}
        out = model.generate(**enc, max_new_tokens=48, **sampling, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    comps = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    rewards = [env.reward(e, c) for e, c in zip(examples, comps, strict=True)]
    return sum(rewards) / len(rewards)


def scale_logits(model_dir: Path, factor: float) -> None:
    """Multiply the final RMSNorm weight by `factor`: with tied embeddings this scales every logit, i.e. it
    is the same as sampling at temperature 1 / factor."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    weights = load_file(str(path))
    weights["model.norm.weight"] = weights["model.norm.weight"] * factor
    save_file(weights, str(path), metadata={"format": "pt"})


def calibrate(model_dir: Path, target: float, steps: int = 7) -> float:
    """Bisect the logit scale in [1, 4] until the temperature-1 mean reward is about `target`."""
    lo, hi, scale = 1.0, 4.0, 1.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        scale_logits(model_dir, mid / scale)
        scale = mid
        reward = evaluate(model_dir, num_prompts=128)
        print(f"logit scale {scale:.3f}: sampled reward {reward:.3f}", flush=True)
        lo, hi = (lo, mid) if reward > target else (mid, hi)
    return scale


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--sft-steps", type=int, default=1000, help="most SFT steps")
    ap.add_argument("--every", type=int, default=50, help="SFT steps between evaluated snapshots")
    ap.add_argument("--smoothing", type=float, default=0.5, help="label smoothing of the SFT targets")
    ap.add_argument("--target", type=float, default=0.9,
                    help="keep the first snapshot whose greedy mean reward reaches this")
    ap.add_argument("--sampled-target", type=float, default=0.4,
                    help="then scale its logits so that temperature-1 samples score about this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-only", action="store_true", help="only print the mean reward of --out")
    args = ap.parse_args()
    if args.eval_only:
        print(f"mean reward (temperature 1): {evaluate(args.out):.3f}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "model"
        work.mkdir()
        build_tokenizer(work)
        build_model(work, args.seed)
        chosen = work
        if args.sft_steps > 0:
            sft_dir = Path(tmp) / "sft"
            warm_start(work, args.sft_steps, args.every, args.seed, sft_dir, args.smoothing)
            snaps = sorted(sft_dir.glob("step_*"), key=lambda p: int(p.name[5:])) + [sft_dir]
            for snap in snaps:
                greedy = evaluate(snap, greedy=True)
                print(f"snapshot {snap.name}: greedy reward {greedy:.3f}, sampled {evaluate(snap):.3f}", flush=True)
                chosen = snap
                if greedy >= args.target:
                    break
        shutil.rmtree(args.out, ignore_errors=True)
        shutil.copytree(chosen, args.out, ignore=shutil.ignore_patterns("step_*"))
        if args.sft_steps > 0:
            calibrate(args.out, args.sampled_target)
    print(f"wrote {args.out} from {chosen.name}; mean reward (temperature 1): {evaluate(args.out):.3f}")


if __name__ == "__main__":
    main()
