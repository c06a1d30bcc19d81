"""`make bench-gpu`: trainer-only throughput of tidal's training step: tokens/s, MFU and peak memory.

Runs anywhere; meaningful on a GPU (H100/H200). No vLLM, no orchestrator: the trainer's own `train_step`
(`tidal.trainer.grpo`: packing -> per micro-batch `forward_logprobs_entropy` with the chunked lm_head
(`logprob_chunk_size`) -> the GRPO loss (`tidal.trainer.step.loss.policy_loss`) -> backward -> gradient clipping ->
AdamW step) on a synthetic `TrainingBatch`, with the policy built the way `tidal.trainer.model.load.load_policy`
builds it (`attn_implementation` for train `attention`, then `prepare_policy`: checkpointing, the activation policy,
`add_lora`, compiled layers), except that the weights are a random init from a transformers `Qwen3Config` with the
real shapes (nothing downloaded):

- Qwen3-0.6B: 28 layers, hidden 1024, MLP 3072, 16 heads / 8 KV heads of 128, tied embeddings;
- Qwen3-4B: 36 layers, hidden 2560, MLP 9728, 32 heads / 8 KV heads of 128, tied embeddings;
- (`--models 8b`, the long-sample rows) Llama-3.1-8B: a `LlamaConfig`, 32 layers, hidden 4096, MLP 14336, 32 heads /
  8 KV heads of 128, vocabulary 128,256, untied; e.g. `--models 8b --tokens 20480 --shapes prime-rl` (one sample);

vocabulary 151,936; LoRA r16 (alpha 32) on all linear layers (q/k/v/o/gate/up/down); bfloat16 on CUDA, float32
on CPU (tidal's `resolve_dtype`). One micro-batch = one row of `--tokens` tokens (16,384 by default); one optimizer
step per training step. Each model is measured in two row shapes (`--shapes`, both by default), each its own table:

- `prime-rl`: one causal sequence of `--tokens` tokens per row, the loss on every token: the shape prime-rl's
  trainer benchmark feeds (`FakeDataLoader`, `generate_samples=False`: one 16,384-token sequence per micro-batch,
  `position_ids` 0..16,383, `loss_mask` all ones). Its anchor was measured on this shape, so only these rows carry
  the ratio to prime-rl (tokens/s, memory), and only in a full-size CUDA run. tidal's flex attention hands such a
  row to SDPA's causal kernel (no mask), so no flex graph is compiled for it.
- `packed`: the GRPO shape: samples of `--sample-len` tokens (1,024; the last one shorter) packed into the row, the
  first quarter of each a prompt (no loss), `position_ids` restarting per sample (no attention across samples).
  Far less attention per token than one 16k sequence (by the MFU formula below a prime-rl-shape row is 2.3x the
  model FLOPs of a packed one for the 0.6B, 1.5x for the 4B), so its tokens/s is not comparable with prime-rl's:
  no ratio. Skipped when `--sample-len` >= `--tokens` (then it is the prime-rl shape).

Measured, in a fresh process per model and shape: `--warmup` steps, each timed on its own (the first one alone is
reported as "first step": the torch.compile of the flex kernel and of its block masks happens there), then
`--steps` timed steps (CUDA synchronized); tokens/s = row tokens x steps / seconds. Compiled graphs, counted after
the warm-up: flex's (`tidal.trainer.model.attention.flex.compiled_graphs()`, with `graph_budget(tokens)`; "n/a" where
that
module has neither) and all of dynamo's (`counters["stats"]["unique_graphs"]`), plus any compiled during the timed
steps (a recompile the warm-up did not cover). `--quick` = 1 warm-up + 3 timed steps (a short GPU lease). Peak
memory: `torch.cuda.max_memory_allocated` over the whole process on CUDA (weights, LoRA, optimizer state,
activations), the peak resident set size (VmHWM) on CPU.

Every measured row is also printed to stdout as one line `BENCH_ROW {json}` (model, shape, first_step_s, graphs,
step_s, tokens_per_s, mfu, peak_gib, the prime-rl ratios or null, ...; a failed one with "error"), for a caller to
parse, e.g. `python bench/gpu_trainer.py --models 0.6b 4b --quick --out $OUT/GPU.md`.

MFU counts model FLOPs per training step the usual way (as prime-rl and PaLM do), not the hardware's:
    FLOPs = 6 * N * T  +  12 * L * n_heads * head_dim * sum_i c_i
N = parameters of every matmul (all `nn.Linear` weights: q/k/v/o/gate/up/down of every layer, the lm_head
once even when tied, the LoRA A/B matrices; not the embedding lookup or the norms), T = tokens in the row,
c_i = keys token i attends to (its position in its sample + 1, causal, no attention across samples: up to 16,384 in
the prime-rl shape, up to 1,024 in the packed one), L layers.
The first term is forward (2N) + backward (4N) per token; the second is QK^T and AV (2 x 2 x n_heads x head_dim
per key) times 3 for forward + backward. MFU = FLOPs / step time / peak, with the bf16 dense peak of 989
TFLOP/s for H100 and H200 (SXM; other GPUs: `--peak-tflops`; CPU: not computed). With LoRA the hardware
actually skips the frozen weights' gradients (-2N) and gradient checkpointing recomputes the forward (+2N), so
for this configuration hardware and model FLOPs about agree; the chunked lm_head runs only on loss positions (every
token in the prime-rl shape, three quarters in the packed one).

`--variants` compares the frozen base and the precision recipe (issue 17) in the same run, each in a fresh
process: `bf16` (the default, as above), `nf4` (`qlora_bnb`), `fp8` (`qlora_fp8`) and `fp8-hybrid` (`recipe:
fp8-hybrid`). For the quantized ones the random model is saved to a temporary directory first and loaded the way
the trainer loads it (`tidal.trainer.model.load.load_policy`: quantized while loading), so their peak memory is the
quantized base's; the ratios against `bf16` are in the table.

`--options` compares the trainer-speed keys of issue 27 (`OPTIONS`: train `attention` flex / per_sample / dense,
`checkpoint_every`, `checkpoint_scope: mlp` / `elementwise`, `offload_activations`, `compile_layers`, no
checkpointing; issue 43: `liger`, train `liger_kernel` with Liger Kernel's RMSNorm, SwiGLU and RoPE, CUDA only,
liger-kernel from the GPU kit's wheel: `liger_path`), each in a fresh process, with a ratio table against
`default` (train.yaml's defaults: flex on CUDA, every layer checkpointed); its section is "<device> options".
`dense` reproduces the attention of every CUDA figure measured before issue 27.

`--profile` (issue 43) profiles the step instead, by kind (base and LoRA matmuls, attention forward / backward,
elementwise, checkpoint recomputation, the logprob / LM-head pass, optimizer, host gaps: `tidal.trainer.profile`):
by default the Qwen3-4B prime-rl-shape row and the Qwen3-0.6B packed row (`PROFILE_ROWS`), each warmed up, timed,
then `--profile-steps` steps under torch.profiler; it writes `--profile-out` (bench/GPU-PROFILE.md: one section per
device kind) and one `PROFILE_ROW {json}` line per row, and leaves `--out` alone. CPU smoke: `--profile --device
cpu --models 0.6b --shapes packed --layers 1 --tokens 128 --sample-len 64 --quick`.

Writes `bench/GPU.md`: one section per device kind (a run replaces its own), next to prime-rl's anchor on one
H100; a run with `--variants` writes its own section ("<device> bases and recipes"), one with a single `--shapes`
its own ("<device> packed shape only"). `--layers`, `--tokens` and `--sample-len` shrink the run for a CPU smoke
test (e.g. `--layers 2 --tokens 256 --sample-len 64 --quick`).
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
sys.path.insert(0, str(REPO / "scripts"))
import harness  # noqa: E402 - the benches' and checks' one harness (tidal.procs)

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
COMMON: dict[str, Any] = dict(vocab_size=VOCAB, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
              tie_word_embeddings=True)
LLAMA_8B: dict[str, Any] = dict(
                vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192})
"""`8b`: Llama-3.1-8B's config (a `LlamaConfig`; the Qwen3 shapes are `Qwen3Config`s), for the long-sample rows
(`--models 8b --tokens 20480 --shapes prime-rl`, and 65,536)."""
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}
"""bf16 dense peak by GPU name."""


sys.path.insert(0, str(REPO / "bench"))
from gpu_trainer_report import (  # noqa: E402 - the report's formatting
    PROFILE_INTRO,
    PROFILE_PENDING,
    bench_row,
    graphs_text,
    label,
    profile_lines,
    shape_text,
    table,
    variant_ratios,
    write_report,
)

# --- child: one model ------------------------------------------------------------------------------------------------

def synthetic_batch(tokens: int, sample_len: int, seed: int = 0, vocab: int = VOCAB, prompt: bool = True) -> Any:
    """A `TrainingBatch` filling one row of `tokens` tokens: samples of `sample_len` (the last one shorter), a
    quarter of each a prompt (no loss) when `prompt`, else the loss on every token (prime-rl's fake data)."""
    import numpy as np

    from tidal.transport.batch import TrainingBatch

    rng = np.random.default_rng(seed)
    lengths = np.array([sample_len] * (tokens // sample_len) + ([tokens % sample_len] if tokens % sample_len else []))
    cut = (lambda n: n // 4) if prompt else (lambda n: 0)
    mask = np.concatenate([np.r_[np.zeros(cut(n)), np.ones(n - cut(n))] for n in lengths])
    adv = np.concatenate([np.full(n, a) for n, a in zip(lengths, rng.normal(size=len(lengths)), strict=True)])
    return TrainingBatch(step=1, temperature=1.0, tokens=rng.integers(0, vocab, size=tokens), lengths=lengths,
                         loss_mask=mask, inference_logprobs=-rng.random(tokens) * 5, advantages=adv,
                         rewards=rng.random(len(lengths)), policy_steps=np.zeros(len(lengths)),
                         truncated=np.zeros(len(lengths), dtype=bool))


ROW_SHAPES = ("prime-rl", "packed")
"""`--shapes`: `prime-rl`, one causal sequence of `--tokens` tokens per row with the loss on every token (prime-rl's
benchmark: `FakeDataLoader`, `generate_samples=False`), the only shape compared with prime-rl; `packed`, the GRPO
shape: samples of `--sample-len` tokens (a quarter prompt) packed into the row, no ratio to prime-rl."""


VARIANTS: dict[str, dict[str, Any]] = {"bf16": {}, "nf4": {"qlora_bnb": True}, "fp8": {"qlora_fp8": True},
                                       "fp8-hybrid": {"recipe": "fp8-hybrid"}}
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
    "ckpt-elementwise": {"checkpoint_scope": "elementwise"},
    "ckpt-elementwise-every-2": {"checkpoint_scope": "elementwise", "checkpoint_every": 2},
    "compiled": {"compile_layers": True},
    "compiled-ckpt-mlp": {"compile_layers": True, "checkpoint_scope": "mlp"},
    "liger": {"liger_kernel": ["rms_norm", "swiglu", "rope"]},
    "liger-ckpt-elementwise": {"liger_kernel": ["rms_norm", "swiglu", "rope"], "checkpoint_scope": "elementwise"},
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
    from tidal.trainer.model.load import load_policy
    from tidal.trainer.step.optim import make_optimizer

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
    from tidal.trainer.model.hf import attn_implementation
    from tidal.trainer.model.load import prepare_policy, resolve_dtype
    from tidal.trainer.step.optim import make_optimizer

    device = torch.device(spec["device"])
    cfg = TrainConfig(model="unused", lora_rank=16, lora_alpha=32, sequence_len=spec["tokens"],
                      per_device_train_batch_size=1, logprob_chunk_size=spec["chunk"], device=spec["device"],
                      **train_keys(spec))
    dtype = resolve_dtype(cfg.recipe, device)
    shape = SHAPES[spec["model"]] | {"num_hidden_layers": spec["layers"]}
    impl = attn_implementation(device, cfg.attention)
    keys: dict[str, Any] = {**(LLAMA_8B if spec["model"] == "8b" else COMMON), **shape, "attn_implementation": impl}
    conf: Any = LlamaConfig(**keys) if spec["model"] == "8b" else Qwen3Config(**keys)
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
    policy = prepare_policy(model, cfg, device)
    return policy, make_optimizer(policy, cfg), cfg, device


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


def graph_counts(tokens: int) -> dict[str, int | None]:
    """Compiled graphs so far in this process: flex's (`tidal.trainer.model.attention.flex.compiled_graphs`, and its
    `graph_budget` for rows of `tokens`; None where flex has neither) and all of dynamo's (unique graphs)."""
    from tidal.trainer.model.attention import flex

    out: dict[str, int | None] = {"flex_graphs": None, "flex_graph_budget": None, "dynamo_graphs": None,
                                  "layer_graphs": None}
    try:
        out["flex_graphs"] = int(flex.compiled_graphs())  # type: ignore[attr-defined]
    except AttributeError:
        pass
    try:
        out["flex_graph_budget"] = int(flex.graph_budget(tokens))  # type: ignore[attr-defined]
    except AttributeError:
        pass
    from tidal.trainer.model import kernels

    out["layer_graphs"] = kernels.compiled_graphs()  # compile_layers' (0 without it)
    try:
        from torch._dynamo.utils import counters

        out["dynamo_graphs"] = int(counters["stats"]["unique_graphs"])
    except (ImportError, AttributeError, KeyError):
        pass
    return out


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Build, warm up (each warm-up step timed on its own: the first includes torch.compile), time `spec`;
    returns the figures."""
    import torch

    from tidal.trainer.grpo import train_step

    if spec["device"] == "cpu":
        torch.set_num_threads(spec["threads"])
    t_build = time.perf_counter()
    model, opt, cfg, device = build(spec)
    cuda = device.type == "cuda"
    build_s = time.perf_counter() - t_build
    batch = synthetic_batch(spec["tokens"], spec["sample_len"],
                            vocab=LLAMA_8B["vocab_size"] if spec["model"] == "8b" else VOCAB,
                            prompt=spec.get("shape", "packed") != "prime-rl")
    shape = SHAPES[spec["model"]]
    n = matmul_params(model)
    flops = step_flops(n, batch, spec["layers"], shape["num_attention_heads"], shape["head_dim"])

    def one() -> dict[str, Any]:
        return train_step(model, opt, batch, cfg, device, pad_id=0)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    warmup_s = []
    for _ in range(spec["warmup"]):
        sync()
        t = time.perf_counter()
        one()
        sync()
        warmup_s.append(time.perf_counter() - t)
    graphs = graph_counts(spec["tokens"])
    sync()
    t0 = time.perf_counter()
    for _ in range(spec["steps"]):
        metrics = one()
    sync()
    seconds = (time.perf_counter() - t0) / spec["steps"]
    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss()
    after = graph_counts(spec["tokens"])
    timed_graphs: dict[str, int | None] = {}  # compiled while timed: a recompile the warm-up did not cover
    for k in ("flex_graphs", "dynamo_graphs", "layer_graphs"):
        before, now = graphs[k], after[k]
        timed_graphs[k] = now - before if now is not None and before is not None else None
    prof = None
    if spec.get("profile"):  # after the timed steps: the profiler's overhead stays out of step_s
        from tidal.trainer.profile import breakdown, profile_steps

        prof = breakdown(profile_steps(one, spec["profile"], cuda), cuda, lora_rank=16,
                         compiled_layers=bool(cfg.compile_layers))
    return {"profile": prof, "step_s": seconds, "tokens_per_s": spec["tokens"] / seconds,
            "tflops_per_step": flops / 1e12,
            "achieved_tflops": flops / seconds / 1e12, "peak_gib": peak / GIB, "matmul_params": n,
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "optim_steps": metrics.get("optim/steps"), "loss": metrics["loss"], "build_s": build_s,
            "warmup_s": warmup_s, "first_step_s": warmup_s[0] if warmup_s else None,
            "samples_per_row": len(batch.lengths), "loss_tokens": int(batch.loss_mask.sum()), **graphs,
            "flex_graphs_timed": timed_graphs["flex_graphs"], "dynamo_graphs_timed": timed_graphs["dynamo_graphs"],
            "layer_graphs_timed": timed_graphs["layer_graphs"]}


# --- parent: the models, the table ----------------------------------------------------------------------------------

def liger_path() -> str:
    """Where liger-kernel imports from for `--options liger*` (train `liger_kernel`): "" when it imports as is, else
    /tmp/site-liger, where the GPU kit's wheel (.gpu-kit/trl/liger_kernel-*.whl, scripts/gpu_kit_trl.sh; pure Python
    over the image's Triton) is installed once per machine with pip --no-index. Without either the child refuses with
    exit 2 (`tidal.trainer.model.kernels.liger`), and the row says so."""
    import glob
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is not None:
        return ""
    site = Path("/tmp/site-liger")
    wheels = sorted(glob.glob(str(REPO / ".gpu-kit" / "*" / "liger_kernel-*.whl")))
    if not (site / "liger_kernel").is_dir() and wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--target", str(site), wheels[-1]], check=False)
    return str(site) if (site / "liger_kernel").is_dir() else ""


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    env = os.environ | {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    if train_keys(spec).get("liger_kernel") and (site := liger_path()):
        env["PYTHONPATH"] = os.pathsep.join([site, *filter(None, [env.get("PYTHONPATH")])])
    if spec["device"] == "cpu":
        env["OMP_NUM_THREADS"] = str(spec["threads"])
    return harness.run_json([sys.executable, __file__, "--child", json.dumps(spec)], 3600, env=env,
                            what=f"{label(spec)} ({spec['shape']})")


PROFILE_ROWS = (("4b", "prime-rl"), ("0.6b", "packed"))
"""`--profile` without `--models` / `--shapes`: the rows issue 43 profiles (4B on prime-rl's shape, 0.6B packed)."""


def profile_main(args: argparse.Namespace, device: str, name: str) -> int:
    """`--profile`: the profiled rows (`PROFILE_ROWS` unless `--models` / `--shapes` say), their tables written
    to `--profile-out` (this device kind's section replaced) and printed, one `PROFILE_ROW {json}` line each."""
    import torch

    pairs = ([(m, s) for m in (args.models or SHAPES) for s in (args.shapes or ROW_SHAPES)]
             if args.models or args.shapes else list(PROFILE_ROWS))
    steps = args.steps if args.steps is not None else 3 if args.quick else 5
    warmup = args.warmup if args.warmup is not None else 1 if args.quick else 2
    lines = [f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {name} (torch {torch.__version__}); command: "
             f"`python bench/gpu_trainer.py {' '.join(sys.argv[1:])}`; {warmup} warm-up + {steps} timed steps, then "
             f"{args.profile_steps} profiled.", ""]
    code = 0
    for model, shape in pairs:
        sample = args.tokens if shape == "prime-rl" else min(args.sample_len, args.tokens)
        spec = dict(model=model, shape=shape, device=device, tokens=args.tokens, sample_len=sample,
                    layers=args.layers or SHAPES[model]["num_hidden_layers"], steps=steps, warmup=warmup,
                    chunk=args.chunk, checkpointing=not args.no_checkpointing, threads=args.threads, variant="bf16",
                    option="default", profile=args.profile_steps)
        try:
            row = spec | run_child(spec)
        except RuntimeError as exc:
            tail = str(exc).strip().splitlines()[-1][:200]
            lines += [f"- {label(spec)}, {shape} shape: failed ({tail})", ""]
            print("PROFILE_ROW " + json.dumps({"model": model, "shape": shape, "error": tail}), flush=True)
            code = 1
            continue
        lines += profile_lines(row)
        print("PROFILE_ROW " + json.dumps({"model": model, "shape": shape, "device": name, "step_s": row["step_s"],
                                           **row["profile"]}), flush=True)
    kind = "CUDA" if device == "cuda" else "CPU (smoke test)"
    sections: dict[str, str] = {}
    out = Path(args.profile_out)
    if out.exists():
        for part in out.read_text().split("\n## ")[1:]:
            sections[part.split("\n", 1)[0].strip()] = "## " + part.rstrip() + "\n"
    sections[kind] = "\n".join([f"## {kind}", "", *lines]).rstrip() + "\n"
    sections.setdefault("CUDA", f"## CUDA\n\n{PROFILE_PENDING}\n")
    out.write_text("\n".join(PROFILE_INTRO) + "\n" + "\n".join(sections[k] for k in sorted(sections)))
    print("\n".join(lines))
    return code


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The benchmark's options (`make bench-gpu BENCH_ARGS=...`) and the parser (for its errors)."""
    from tidal.config.train import DEFAULT_LOGPROB_CHUNK_SIZE

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=None,
                    help="models (default 0.6b 4b; with --profile: PROFILE_ROWS)")
    ap.add_argument("--shapes", nargs="+", choices=ROW_SHAPES, default=None,
                    help="row shapes: prime-rl (one causal --tokens sequence per row, compared with prime-rl) and "
                         "packed (--sample-len samples, no prime-rl ratio); default both")
    ap.add_argument("--profile", action="store_true",
                    help="profile the step by kind with torch.profiler (the 4B prime-rl row and the 0.6B packed row "
                         "unless --models / --shapes say); writes --profile-out, not --out")
    ap.add_argument("--profile-steps", type=int, default=1, help="steps profiled per row (--profile; default 1)")
    ap.add_argument("--profile-out", default=str(REPO / "bench" / "GPU-PROFILE.md"),
                    help="--profile's markdown (default bench/GPU-PROFILE.md)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per row (one micro-batch)")
    ap.add_argument("--sample-len", type=int, default=1024,
                    help="tokens per sample of the packed shape (a quarter prompt)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the real model's)")
    ap.add_argument("--steps", type=int, default=None, help="timed training steps (default 5; --quick: 3)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed steps first, each timed apart: the first includes compiling (default 2; --quick: 1)")
    ap.add_argument("--quick", action="store_true", help="1 warm-up + 3 timed steps (for a short GPU lease)")
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
    return ap, ap.parse_args()


def run_rows(args: argparse.Namespace, shapes: list[str], sample: int, steps: int, warmup: int, device: str,
             name: str, peak: float | None, compare: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """Each model x shape x variant x option in a fresh child (`run_child`), printed as it comes (with its
    `BENCH_ROW` line); (rows measured, lines of the ones that failed)."""
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    for model in args.models:
        for shape in shapes:
            for variant, option in [(v, o) for v in args.variants or ["bf16"] for o in args.options or ["default"]]:
                layers = args.layers or SHAPES[model]["num_hidden_layers"]
                spec = dict(model=model, shape=shape, device=device, tokens=args.tokens,
                            sample_len=args.tokens if shape == "prime-rl" else sample, layers=layers, steps=steps,
                            warmup=warmup, chunk=args.chunk, checkpointing=not args.no_checkpointing,
                            threads=args.threads, variant=variant, option=option)
                try:
                    res = run_child(spec)
                except RuntimeError as exc:  # e.g. out of memory without checkpointing: say so, measure the rest
                    tail = str(exc).strip().splitlines()[-1][:200]
                    failed.append(f"- {label(spec)}, {shape} shape: failed ({tail})")
                    print(failed[-1], flush=True)
                    print("BENCH_ROW " + json.dumps({"model": model, "shape": shape, "variant": variant,
                                                     "option": option, "label": label(spec), "device": name,
                                                     "error": tail}), flush=True)
                    continue
                row = spec | res
                rows.append(row)
                first = row["first_step_s"]
                print(f"{label(spec)} ({shape}): {res['tokens_per_s']:,.0f} tokens/s, {res['achieved_tflops']:.2f} "
                      f"TFLOP/s, peak {res['peak_gib']:.2f} GiB, {res['step_s']:.3f} s/step; first step "
                      f"{'n/a' if first is None else f'{first:.1f} s'}, graphs {graphs_text(row)}", flush=True)
                print(bench_row(row, peak, compare, name), flush=True)
    return rows, failed


def main() -> int:
    ap, args = parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    import torch

    steps = args.steps if args.steps is not None else 3 if args.quick else 5
    warmup = args.warmup if args.warmup is not None else 1 if args.quick else 2
    if steps < 1 or warmup < 0 or args.profile_steps < 1:
        ap.error("--steps and --profile-steps must be >= 1 and --warmup >= 0")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device == "cuda" else f"{platform.machine()} CPU, {args.threads} threads"
    if args.profile:
        return profile_main(args, device, name)
    args.models, args.shapes = args.models or ["0.6b", "4b"], args.shapes or list(ROW_SHAPES)
    peak = args.peak_tflops or (next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
                                if device == "cuda" else None)
    full_size = (device == "cuda" and args.tokens == 16384 and args.layers is None and not args.no_checkpointing
                 and args.models != ["8b"])
    compare = full_size and not args.variants
    t0 = time.monotonic()
    sample = min(args.sample_len, args.tokens)
    shapes = [s for s in ROW_SHAPES if s in args.shapes]
    notes: list[str] = []
    if "prime-rl" in shapes and "packed" in shapes and sample >= args.tokens:
        shapes.remove("packed")  # one sample per row: the prime-rl shape already is it
        notes.append(f"- packed shape: not run, since --sample-len {args.sample_len:,} >= --tokens {args.tokens:,} "
                     f"makes it one sequence per row (the prime-rl shape's rows).")
    rows, failed = run_rows(args, shapes, sample, steps, warmup, device, name, peak, compare)
    lines = [f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {name} (torch {torch.__version__}) in "
             f"{time.monotonic() - t0:.0f} s; command: `python bench/gpu_trainer.py {' '.join(sys.argv[1:])}`.", "",
             f"{'bfloat16' if device == 'cuda' else 'float32'}, {args.tokens:,} tokens per row (one micro-batch), "
             f"gradient checkpointing {'off' if args.no_checkpointing else 'on'}, logprob_chunk_size {args.chunk}; "
             f"{warmup} warm-up + {steps} timed steps, each model and shape in a fresh process; first step = the first "
             f"warm-up step alone (any torch.compile included: flex's kernel and block masks, compiled layers), "
             f"graphs counted after the warm-up (and any compiled while timed); peak = "
             f"{'torch.cuda.max_memory_allocated' if device == 'cuda' else 'peak RSS (VmHWM)'} of the process. "
             f"MFU against {f'{peak:.0f} TFLOP/s' if peak else 'no known peak (n/a)'}."
             + ("" if full_size else " Not the full-size configuration, so no comparison with prime-rl.")
             + (" With --variants, no comparison with prime-rl." if full_size and args.variants else "")]
    for shape in shapes:
        shape_rows = [r for r in rows if r["shape"] == shape]
        if shape_rows:
            lines += ["", shape_text(shape, args.tokens, sample), "", *table(shape_rows, peak, compare, shape)]
    if args.variants or args.options:
        lines += ["", *variant_ratios(rows)]
    if failed or notes:
        lines += ["", "Not measured:", *notes, *failed]
    kind = "CUDA" if device == "cuda" else "CPU (smoke test)"
    parts = [kind, *(["Llama-3.1-8B", f"{args.tokens:,}-token samples"] if args.models == ["8b"] else []),
             *([f"{' and '.join(args.shapes)} shape only"] if set(args.shapes) != set(ROW_SHAPES) else []),
             *(["bases and recipes"] if args.variants else []), *(["options"] if args.options else [])]
    write_report(Path(args.out), " ".join(parts), lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
