"""`make bench-gpu`: trainer-only throughput of tidal's training step: tokens/s, MFU and peak memory.

Runs anywhere; meaningful on a GPU (H100/H200). No vLLM, no orchestrator: the trainer's own `train_step`
(`tidal.trainer.grpo`: packing -> per micro-batch `forward_logprobs_entropy` with the chunked lm_head
(`logprob_chunk_size`) -> the GRPO loss (`tidal.trainer.loss.policy_loss`) -> backward -> gradient clipping ->
AdamW step) on a synthetic `TrainingBatch`, with the policy built the way `tidal.trainer.model.load_policy`
builds it (`attn_implementation` for train `attention`, then `prepare_policy`: checkpointing, the activation policy,
`add_lora`, compiled layers), except that the weights are a random init from a transformers `Qwen3Config` with the
real shapes (nothing downloaded):

- Qwen3-0.6B: 28 layers, hidden 1024, MLP 3072, 16 heads / 8 KV heads of 128, tied embeddings;
- Qwen3-4B: 36 layers, hidden 2560, MLP 9728, 32 heads / 8 KV heads of 128, tied embeddings;
- (`--models 8b`, the long-sample rows) Llama-3.1-8B: a `LlamaConfig`, 32 layers, hidden 4096, MLP 14336, 32 heads /
  8 KV heads of 128, vocabulary 128,256, untied; e.g. `--models 8b --tokens 20480 --sample-len 20480` (one sample);

vocabulary 151,936; LoRA r16 (alpha 32) on all linear layers (q/k/v/o/gate/up/down); bfloat16 on CUDA, float32
on CPU (tidal's `resolve_dtype`). One micro-batch = one packed row of `--tokens` tokens (16,384 by default):
samples of `--sample-len` tokens (the last one shorter), the first quarter of each a prompt (no loss),
`position_ids` restarting per sample (no attention across samples); one optimizer step per training step.

Measured, in a fresh process per model: `--warmup` steps, then `--steps` timed steps (CUDA synchronized);
tokens/s = row tokens x steps / seconds. Peak memory: `torch.cuda.max_memory_allocated` over the whole process
on CUDA (weights, LoRA, optimizer state, activations), the peak resident set size (VmHWM) on CPU.

MFU counts model FLOPs per training step the usual way (as prime-rl and PaLM do), not the hardware's:
    FLOPs = 6 * N * T  +  12 * L * n_heads * head_dim * sum_i c_i
N = parameters of every matmul (all `nn.Linear` weights: q/k/v/o/gate/up/down of every layer, the lm_head
once even when tied, the LoRA A/B matrices; not the embedding lookup or the norms), T = tokens in the row,
c_i = keys token i attends to (its position in its sample + 1, causal, no attention across samples), L layers.
The first term is forward (2N) + backward (4N) per token; the second is QK^T and AV (2 x 2 x n_heads x head_dim
per key) times 3 for forward + backward. MFU = FLOPs / step time / peak, with the bf16 dense peak of 989
TFLOP/s for H100 and H200 (SXM; other GPUs: `--peak-tflops`; CPU: not computed). With LoRA the hardware
actually skips the frozen weights' gradients (-2N) and gradient checkpointing recomputes the forward (+2N), so
for this configuration hardware and model FLOPs about agree; the chunked lm_head runs only on loss positions.

`--variants` compares the frozen base and the precision recipe (issue 17) in the same run, each in a fresh
process: `bf16` (the default, as above), `nf4` (`qlora_bnb`), `fp8` (`qlora_fp8`) and `fp8-hybrid` (`recipe:
fp8-hybrid`). For the quantized ones the random model is saved to a temporary directory first and loaded the way
the trainer loads it (`tidal.trainer.model.load_policy`: quantized while loading), so their peak memory is the
quantized base's; the ratios against `bf16` are in the table.

`--options` compares the trainer-speed keys of issue 27 (`OPTIONS`: train `attention` flex / per_sample / dense,
`checkpoint_every`, `checkpoint_scope: mlp`, `offload_activations`, `compile_layers`, no checkpointing), each in a
fresh process, with a ratio table against `default` (train.yaml's defaults: flex on CUDA, every layer
checkpointed); its section is "<device> options". `dense` reproduces the attention of every CUDA figure measured
before issue 27.

Writes `bench/GPU.md`: one section per device kind (a run replaces its own), next to prime-rl's anchor on one
H100; a run with `--variants` writes its own section ("<device> bases and recipes"). `--layers` and `--tokens`
shrink the run for a CPU smoke test (e.g. `--layers 2 --tokens 256`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

GIB = 1024**3
VOCAB = 151936
SHAPES: dict[str, dict[str, Any]] = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128),
}
COMMON = dict(vocab_size=VOCAB, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
              tie_word_embeddings=True)
LLAMA_8B = dict(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})
"""`8b`: Llama-3.1-8B's config (a `LlamaConfig`; the Qwen3 shapes are `Qwen3Config`s), for the long-sample rows
(`--models 8b --tokens 20480 --sample-len 20480`, and 65,536)."""
NAMES = {"0.6b": "Qwen3-0.6B", "4b": "Qwen3-4B", "8b": "Llama-3.1-8B"}
ANCHOR = {"0.6b": (13.34e3, 10.9, 5.1), "4b": (6.23e3, 21.7, 23.3)}
"""prime-rl on one H100, LoRA: tokens/s, MFU %, peak GiB (the figures issue 14 quotes)."""
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}
"""bf16 dense peak by GPU name."""


# --- child: one model ------------------------------------------------------------------------------------------------

def synthetic_batch(tokens: int, sample_len: int, seed: int = 0, vocab: int = VOCAB) -> Any:
    """A `TrainingBatch` filling one row of `tokens` tokens: samples of `sample_len` (the last one shorter), a
    quarter of each a prompt."""
    import numpy as np

    from tidal.transport.batch import TrainingBatch

    rng = np.random.default_rng(seed)
    lengths = np.array([sample_len] * (tokens // sample_len) + ([tokens % sample_len] if tokens % sample_len else []))
    mask = np.concatenate([np.r_[np.zeros(n // 4), np.ones(n - n // 4)] for n in lengths])
    adv = np.concatenate([np.full(n, a) for n, a in zip(lengths, rng.normal(size=len(lengths)), strict=True)])
    return TrainingBatch(step=1, temperature=1.0, tokens=rng.integers(0, vocab, size=tokens), lengths=lengths,
                         loss_mask=mask, inference_logprobs=-rng.random(tokens) * 5, advantages=adv,
                         rewards=rng.random(len(lengths)), policy_steps=np.zeros(len(lengths)),
                         truncated=np.zeros(len(lengths), dtype=bool))


VARIANTS = {"bf16": {}, "nf4": {"qlora_bnb": True}, "fp8": {"qlora_fp8": True}, "fp8-hybrid": {"recipe": "fp8-hybrid"}}
"""`--variants`: the train keys each sets."""
OPTIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "dense": {"attention": "dense"},
    "per-sample": {"attention": "per_sample"},
    "flex": {"attention": "flex"},
    "no-ckpt": {"gradient_checkpointing": False},
    "ckpt-every-2": {"checkpoint_every": 2},
    "ckpt-every-4": {"checkpoint_every": 4},
    "ckpt-mlp": {"checkpoint_scope": "mlp"},
    "ckpt-every-2-offload": {"checkpoint_every": 2, "offload_activations": True},
    "ckpt-mlp-offload": {"checkpoint_scope": "mlp", "offload_activations": True},
    "offload": {"gradient_checkpointing": False, "offload_activations": True},
    "compiled": {"compile_layers": True},
    "compiled-ckpt-mlp": {"compile_layers": True, "checkpoint_scope": "mlp"},
}
"""`--options`: the trainer-speed keys of issue 27 each sets (on top of the variant's; `default` = train.yaml's
defaults: `attention: auto`, i.e. flex on CUDA and per-sample on CPU, and every layer checkpointed unless
`--no-checkpointing`). `dense` is the attention every CUDA figure before issue 27 used."""


def train_keys(spec: dict[str, Any]) -> dict[str, Any]:
    """The train keys of `spec`: its variant's and option's, checkpointing per `--no-checkpointing` unless the
    option says."""
    keys = {"gradient_checkpointing": spec["checkpointing"], **VARIANTS[spec["variant"]],
            **OPTIONS[spec.get("option", "default")]}
    if not keys["gradient_checkpointing"]:
        keys = {k: v for k, v in keys.items() if k not in ("checkpoint_every", "checkpoint_scope")}
    return keys


def build_loaded(spec: dict[str, Any], model: Any) -> tuple[Any, Any, Any, Any]:
    """(policy, optimizer, train config, device) for a `--variants` entry: `model` saved, then loaded as the trainer
    loads train.yaml's model with the variant's keys (`load_policy`)."""
    import tempfile

    import torch

    from tidal.config.train import TrainConfig
    from tidal.trainer.model import load_policy
    from tidal.trainer.optim import make_optimizer

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        del model
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        cfg = TrainConfig(model=tmp, lora_rank=16, lora_alpha=32, sequence_len=spec["tokens"],
                          per_device_train_batch_size=1, logprob_chunk_size=spec["chunk"], device=spec["device"],
                          **train_keys(spec))
        policy, device = load_policy(cfg)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # the saved full-precision copy is gone: measure the training only
    return policy, make_optimizer(policy, cfg), cfg, device


def build(spec: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """(policy, optimizer, train config, device) for `spec`, the way the trainer builds them (`load_policy`'s
    `attn_implementation` and `prepare_policy` on a random-init model)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from tidal.config.train import TrainConfig
    from tidal.trainer.model import attn_implementation, prepare_policy, resolve_dtype
    from tidal.trainer.optim import make_optimizer

    device = torch.device(spec["device"])
    cfg = TrainConfig(model="unused", lora_rank=16, lora_alpha=32, sequence_len=spec["tokens"],
                      per_device_train_batch_size=1, logprob_chunk_size=spec["chunk"], device=spec["device"],
                      **train_keys(spec))
    dtype = resolve_dtype(cfg.recipe, device)
    shape = SHAPES[spec["model"]] | {"num_hidden_layers": spec["layers"]}
    impl = attn_implementation(device, cfg.attention)
    conf: Any = (LlamaConfig(**LLAMA_8B, **shape, attn_implementation=impl) if spec["model"] == "8b"
                 else Qwen3Config(**COMMON, **shape, attn_implementation=impl))
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialize in the training dtype, as from_pretrained(dtype=...) loads
    try:
        with torch.device(device):
            model = (LlamaForCausalLM if spec["model"] == "8b" else Qwen3ForCausalLM)(conf)
    finally:
        torch.set_default_dtype(default)
    if spec.get("variant", "bf16") != "bf16":
        return build_loaded(spec, model)
    model = prepare_policy(model, cfg, device)
    return model, make_optimizer(model, cfg), cfg, device


def matmul_params(model: Any) -> int:
    """N: elements of every distinct `nn.Linear` weight (lm_head once even when tied; LoRA A/B included)."""
    import torch

    seen = {id(m.weight): m.in_features * m.out_features  # the logical shape: a quantized weight is packed
            for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return sum(seen.values())


def step_flops(n_params: int, batch: Any, layers: int, heads: int, head_dim: int) -> float:
    """Model FLOPs of one training step on `batch` (module docstring)."""
    keys = sum(n * (n + 1) / 2 for n in batch.lengths.tolist())  # sum over tokens of (position + 1)
    return 6.0 * n_params * int(batch.lengths.sum()) + 12.0 * layers * heads * head_dim * keys


def peak_rss() -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(r"^VmHWM:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) * 1024 if match else 0


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Build, warm up, time `spec`; returns the figures."""
    import torch

    from tidal.trainer.grpo import train_step

    if spec["device"] == "cpu":
        torch.set_num_threads(spec["threads"])
    t_build = time.perf_counter()
    model, opt, cfg, device = build(spec)
    cuda = device.type == "cuda"
    build_s = time.perf_counter() - t_build
    batch = synthetic_batch(spec["tokens"], spec["sample_len"],
                            vocab=LLAMA_8B["vocab_size"] if spec["model"] == "8b" else VOCAB)
    shape = SHAPES[spec["model"]]
    n = matmul_params(model)
    flops = step_flops(n, batch, spec["layers"], shape["num_attention_heads"], shape["head_dim"])

    def one() -> dict[str, Any]:
        return train_step(model, opt, batch, cfg, device, pad_id=0)

    for _ in range(spec["warmup"]):
        one()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(spec["steps"]):
        metrics = one()
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / spec["steps"]
    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss()
    return {"step_s": seconds, "tokens_per_s": spec["tokens"] / seconds, "tflops_per_step": flops / 1e12,
            "achieved_tflops": flops / seconds / 1e12, "peak_gib": peak / GIB, "matmul_params": n,
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "optim_steps": metrics.get("optim/steps"), "loss": metrics["loss"], "build_s": build_s}


# --- parent: the models, the table ----------------------------------------------------------------------------------

def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    env = os.environ | {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    if spec["device"] == "cpu":
        env["OMP_NUM_THREADS"] = str(spec["threads"])
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, capture_output=True,
                          text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['model']} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def table(rows: list[dict[str, Any]], peak_tflops: float | None, full_size: bool) -> list[str]:
    out = ["| model | layers | tokens per row | step (s) | tokens/s | model TFLOP per step | TFLOP/s | MFU | "
           "peak memory (GiB) |" + (" vs prime-rl: tokens/s | vs prime-rl: memory |" if full_size else ""),
           "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if full_size else "")]
    for r in rows:
        mfu = f"{100 * r['achieved_tflops'] / peak_tflops:.1f}%" if peak_tflops else "n/a"
        line = (f"| {label(r)} | {r['layers']} | {r['tokens']} | {r['step_s']:.3f} | "
                f"{r['tokens_per_s']:,.0f} | {r['tflops_per_step']:.2f} | {r['achieved_tflops']:.3g} | {mfu} | "
                f"{r['peak_gib']:.2f} |")
        if full_size and r["model"] in ANCHOR:
            tps, _, mem = ANCHOR[r["model"]]
            line += f" {r['tokens_per_s'] / tps:.2f}x | {r['peak_gib'] / mem:.2f}x |"
        elif full_size:
            line += " | |"
        out.append(line)
    return out


def label(r: dict[str, Any]) -> str:
    """A row's name: the model, then its variant and option when not the defaults."""
    extra = [x for x in (r.get("variant", "bf16"), r.get("option", "default")) if x not in ("bf16", "default")]
    return " ".join([NAMES[r["model"]], *extra])


def variant_ratios(rows: list[dict[str, Any]]) -> list[str]:
    """Each variant / option against `bf16` `default` of the same model, measured in the same run."""
    out = ["| model | variant / option | tokens/s vs default | peak memory vs default |", "|---|---|---|---|"]
    for r in rows:
        ref = next((b for b in rows if b["model"] == r["model"] and b["variant"] == "bf16"
                    and b["option"] == "default"), None)
        if ref is not None and r is not ref:
            speed, memory = r["tokens_per_s"] / ref["tokens_per_s"], r["peak_gib"] / ref["peak_gib"]
            out.append(f"| {NAMES[r['model']]} | {label(r).removeprefix(NAMES[r['model']]).strip()} | {speed:.2f}x | "
                       f"{memory:.2f}x |")
    return out


def anchor_lines() -> list[str]:
    return ["| model | tokens/s | MFU | peak memory (GiB) |", "|---|---|---|---|",
            *(f"| Qwen3-{m.upper()} LoRA | {t:,.0f} | {f}% | {g} |" for m, (t, f, g) in ANCHOR.items())]


PENDING = ("Not measured yet: no GPU was available to the session that wrote this benchmark (issue 14's target is "
           ">= 1.5x prime-rl's tokens/s at no more memory). On an H100 or H200: `make bench-gpu` (both models, 16k "
           "tokens per row, all 28 / 36 layers) replaces this section with measured figures.")


def write_report(path: Path, device_kind: str, lines: list[str]) -> None:
    """Replace (or add) this device kind's section of `path`, keeping the others; a missing CUDA section says it
    is still to be measured."""
    sections: dict[str, str] = {}
    if path.exists():
        for part in path.read_text().split("\n## ")[1:]:
            sections[part.split("\n", 1)[0].strip()] = "## " + part.rstrip() + "\n"
    sections[device_kind] = "\n".join([f"## {device_kind}", "", *lines]) + "\n"
    sections.setdefault("CUDA", "\n".join(["## CUDA", "", PENDING]) + "\n")
    intro = "\n".join([
        "# Trainer throughput: tokens/s, MFU and peak memory of tidal's training step", "",
        "Written by `make bench-gpu` (bench/gpu_trainer.py; its docstring says what is measured and how). Qwen3-0.6B "
        "and Qwen3-4B shapes (random init, vocabulary 151,936), LoRA r16 on all linear layers, one packed row of "
        "16,384 tokens per micro-batch, tidal's `train_step` (chunked logprobs, GRPO loss, AdamW), gradient "
        "checkpointing on. MFU = (6 N T + 12 L n_heads head_dim sum_i c_i) / step time / 989 TFLOP/s (bf16 dense, "
        "H100/H200); N = matmul parameters, c_i = keys token i attends to (causal, within its sample).", "",
        "Anchor: prime-rl on one H100 (the figures issue 14 quotes). Their sample lengths, checkpointing and MFU "
        "formula are not known here (counting attention over the whole 16k row, or the embedding table in N, gives "
        "a higher MFU than this formula for the same speed), so compare tokens/s and memory first:", "",
        *anchor_lines(), "",
        "One section per device kind; a run replaces its own. The CPU section is a smoke test of the script "
        "(a few layers, short rows): its figures say nothing about GPU throughput.", ""])
    path.write_text(intro + "\n" + "\n".join(sections[k] for k in sorted(sections)))


def main() -> int:
    from tidal.config.train import DEFAULT_LOGPROB_CHUNK_SIZE

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=["0.6b", "4b"])
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per packed row (one micro-batch)")
    ap.add_argument("--sample-len", type=int, default=1024, help="tokens per sample in the row (a quarter prompt)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the real model's)")
    ap.add_argument("--steps", type=int, default=5, help="timed training steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--chunk", type=int, default=DEFAULT_LOGPROB_CHUNK_SIZE, help="logprob_chunk_size")
    ap.add_argument("--no-checkpointing", action="store_true", help="without gradient checkpointing")
    ap.add_argument("--peak-tflops", type=float, default=None, help="bf16 dense peak (default: 989 on H100/H200)")
    ap.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 2), help="CPU threads")
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=None,
                    help="compare frozen bases / recipes (bf16 nf4 fp8 fp8-hybrid) in one run")
    ap.add_argument("--options", nargs="+", choices=list(OPTIONS), default=None,
                    help="compare trainer-speed options (attention kernel, checkpointing, offload, compiled layers; "
                         "OPTIONS) in one run")
    ap.add_argument("--out", default=str(REPO / "bench" / "GPU.md"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device == "cuda" else f"{platform.machine()} CPU, {args.threads} threads"
    peak = args.peak_tflops or (next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
                                if device == "cuda" else None)
    t0 = time.monotonic()
    sample = min(args.sample_len, args.tokens)
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    for model in args.models:
        for variant, option in [(v, o) for v in args.variants or ["bf16"] for o in args.options or ["default"]]:
            layers = args.layers or SHAPES[model]["num_hidden_layers"]
            spec = dict(model=model, device=device, tokens=args.tokens, sample_len=args.sample_len, layers=layers,
                        steps=args.steps, warmup=args.warmup, chunk=args.chunk,
                        checkpointing=not args.no_checkpointing, threads=args.threads, variant=variant,
                        option=option)
            try:
                res = run_child(spec)
            except RuntimeError as exc:  # e.g. out of memory without checkpointing: say so, measure the rest
                tail = str(exc).strip().splitlines()[-1][:200]
                failed.append(f"- {label(spec)}: failed ({tail})")
                print(failed[-1], flush=True)
                continue
            rows.append(spec | res)
            print(f"{label(spec)}: {res['tokens_per_s']:,.0f} tokens/s, {res['achieved_tflops']:.2f} "
                  f"TFLOP/s, peak {res['peak_gib']:.2f} GiB, {res['step_s']:.3f} s/step", flush=True)
    full_size = (device == "cuda" and args.tokens == 16384 and args.layers is None and not args.no_checkpointing
                 and args.models != ["8b"])
    lines = [f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {name} (torch {torch.__version__}) in "
             f"{time.monotonic() - t0:.0f} s; command: `python bench/gpu_trainer.py {' '.join(sys.argv[1:])}`.", "",
             f"{'bfloat16' if device == 'cuda' else 'float32'}, samples of {sample} tokens "
             f"({sample // 4} prompt), gradient checkpointing {'off' if args.no_checkpointing else 'on'}, "
             f"logprob_chunk_size {args.chunk}; {args.warmup} warm-up + {args.steps} timed steps; peak = "
             f"{'torch.cuda.max_memory_allocated' if device == 'cuda' else 'peak RSS (VmHWM)'} of the process. "
             f"MFU against {f'{peak:.0f} TFLOP/s' if peak else 'no known peak (n/a)'}."
             + ("" if full_size else " Not the full-size configuration, so no comparison with prime-rl."), "",
             *table(rows, peak, full_size and not args.variants)]
    if args.variants or args.options:
        lines += ["", *variant_ratios(rows)]
    if failed:
        lines += ["", "Not measured:", *failed]
    kind = "CUDA" if device == "cuda" else "CPU (smoke test)"
    parts = [kind, *(["Llama-3.1-8B", f"{args.tokens:,}-token samples"] if args.models == ["8b"] else []),
             *(["bases and recipes"] if args.variants else []), *(["options"] if args.options else [])]
    write_report(Path(args.out), " ".join(parts), lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
