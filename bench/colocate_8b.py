"""The moonshot run (issue 28): GRPO on a Llama-3.1-8B-shaped model at 20k context, co-located on one GPU, within
40 GB (nvidia-smi's peak), with and without shared base weights.

Model: a random init from a transformers `LlamaConfig` with Llama-3.1-8B's shapes (32 layers, hidden 4096, MLP
14336, 32 heads / 8 KV heads of 128, vocabulary 128,256, untied lm_head, llama3 RoPE), saved in bfloat16 with
the bundled tokenizer (`--layers N` shrinks it for a smoke run; nothing is downloaded). Task: reverse-text with
texts of `--prompt-chars` characters (the bundled character tokenizer: ~1 token per character), completions of
up to `--max-tokens` tokens (a random model rarely stops), so prompt + completion is ~20k tokens; 8 rollouts per
prompt, one prompt per step, `--steps` steps; trainer: LoRA r16 on all linear layers, gradient checkpointing,
`sequence_len` = the context.

Variants (`--variants`, each a full `tidal grpo` run in a fresh run directory):
- `own`: the trainer loads its own bf16 copy of the base (train `share_base_weights: false`);
- `shared`: the trainer's base is vLLM's tensors (train `share_base_weights: true`, docs/colocate.md);
- `shared-fp8kv`: shared, with an fp8 KV cache (infer `kv_cache_dtype: fp8`);
- `own-nf4-fp8kv`: the trainer's own NF4 base (train `qlora_bnb`), fp8 KV cache.
vLLM's KV cache is sized by need in each (`--kv-cache-memory-bytes`: 8 rollouts x context x bytes per token
(128 KiB/token in bf16 for this shape, half in fp8) x 1.1), CUDA graphs off (`--eager`, the default) to keep
their memory out of the way. Activation offload is not a trainer option (yet): not a lever here.

Measured per variant: nvidia-smi's peak `memory.used` of the GPU over the whole run (polled every 0.5 s; the
number the 40 GB target is about), vLLM's own lines (weights, KV cache) from its log, the trainer's
`memory/peak_gb` (torch's peak allocation per step) from metrics.jsonl, the mismatch KL and the wall time.
Writes its section of `bench/GPU.md` ("Co-located GRPO ..."; a run replaces that section only), with the rows of
earlier invocations on the same machine (`--work`/rows.json), so the variants can run one per command.

GPU run (one command; the GPU kit installs vLLM first, ../shared/gpu-kit/README.md):
    source .gpu-kit/install.sh && python bench/colocate_8b.py --variants shared own 2>&1 | tail -40
Smoke run (any GPU, minutes): `python bench/colocate_8b.py --layers 2 --prompt-chars 512 --max-tokens 256`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "scripts"))
import harness  # noqa: E402 - the benches' and checks' one harness (tidal.procs)

GIB = 1024**3
LLAMA_3_1_8B: dict[str, Any] = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
    "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
VARIANTS: dict[str, dict[str, Any]] = {
    "own": {"train": {"share_base_weights": False}, "infer": {}},
    "shared": {"train": {"share_base_weights": True}, "infer": {}},
    "shared-fp8kv": {"train": {"share_base_weights": True}, "infer": {"kv_cache_dtype": "fp8"}},
    "own-nf4-fp8kv": {"train": {"share_base_weights": False, "qlora_bnb": True}, "infer": {"kv_cache_dtype": "fp8"}},
}
VLLM_LINES = {"weights_gib": r"Model loading took ([\d.]+) GiB",
              "kv_cache_gib": r"Available KV cache memory: ([\d.]+) GiB"}


def build_model(out: Path, layers: int | None) -> Path:
    """The random-init Llama-3.1-8B-shaped model directory (bf16; built on the GPU, written once)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tidal.assets import ASSETS

    spec = {**LLAMA_3_1_8B, **({"num_hidden_layers": layers} if layers else {})}
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**spec), dtype=torch.bfloat16)
    model.save_pretrained(str(out))
    del model
    torch.cuda.empty_cache()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(ASSETS / "tiny-reverse" / f, out / f)
    return out


def kv_bytes_per_token(spec: dict[str, Any], fp8: bool) -> int:
    """K and V of every layer for one token: 2 x layers x KV heads x head_dim x (2 bytes bf16, 1 fp8)."""
    return 2 * spec["num_hidden_layers"] * spec["num_key_value_heads"] * spec["head_dim"] * (1 if fp8 else 2)


def write_configs(run: Path, model: Path, variant: str, args: argparse.Namespace, spec: dict[str, Any]) -> Path:
    """train.yaml / infer.yaml / orch.yaml of one variant under `run` (JSON is YAML); returns the directory."""
    context = args.prompt_chars + args.max_tokens + 64
    v = VARIANTS[variant]
    fp8 = v["infer"].get("kv_cache_dtype") == "fp8"
    kv = int(args.rollouts * context * kv_bytes_per_token(spec, fp8) * 1.1)
    infer = {"model": str(model), "dtype": "bfloat16", "max_model_len": context, "enforce_eager": args.eager,
             "max_lora_rank": 16, "max_loras": 1, "enable_prefix_caching": True,
             "extra_args": ["--kv-cache-memory-bytes", str(kv), "--max-num-seqs", str(args.rollouts)], **v["infer"]}
    train = {"model": str(model), "sequence_len": context, "gradient_checkpointing": True, "lora_rank": 16,
             "lora_alpha": 32, "per_device_train_batch_size": 1, "gradient_accumulation_steps": args.rollouts,
             "learning_rate": 1e-5, **v["train"]}
    orch = {"model": {"name": str(model)}, "batch_size": args.rollouts, "rollouts_per_example": args.rollouts,
            "seq_len": context, "max_steps": args.steps, "output_dir": str(run / "out"),
            "env": [{"id": "reverse-text", "args": {"min_len": args.prompt_chars, "max_len": args.prompt_chars}}],
            "sampling": {"max_tokens": args.max_tokens, "temperature": 1.0}}
    cfg = run / "configs"
    cfg.mkdir(parents=True, exist_ok=True)
    for name, body in (("train", train), ("infer", infer), ("orch", orch)):
        (cfg / f"{name}.yaml").write_text(json.dumps(body, indent=1))
    return cfg


class SmiPeak:
    """nvidia-smi's `memory.used` (MiB) of GPU `index`, polled every 0.5 s in a thread; `peak` its maximum."""

    def __init__(self, index: str) -> None:
        self.index, self.peak, self._stop = index, 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i",
                                  self.index], capture_output=True, text=True).stdout.strip()
            if out.isdigit():
                self.peak = max(self.peak, int(out))
            time.sleep(0.5)

    def stop(self) -> float:
        """The peak in GB (10^9 bytes, as the 40 GB target) after stopping the poll."""
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak * 2**20 / 1e9


def run_variant(root: Path, model: Path, variant: str, args: argparse.Namespace, spec: dict[str, Any]) -> dict:
    run = root / variant
    shutil.rmtree(run, ignore_errors=True)
    cfg = write_configs(run, model, variant, args, spec)
    smi = SmiPeak(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0")
    start = time.monotonic()
    code, out = harness.run([sys.executable, "-m", "tidal.cli", "grpo", "--train", str(cfg / "train.yaml"), "--infer",
                           str(cfg / "infer.yaml"), "--orch", str(cfg / "orch.yaml")], run / "grpo.log",
                          args.timeout, env={**os.environ, "TIDAL_PLAIN": "1"}, name=f"grpo-{variant}")
    row: dict[str, Any] = {"variant": variant, "exit": -9 if code is None else code,
                           "seconds": time.monotonic() - start, "smi_peak_gb": smi.stop()}
    infer_log = run / "out" / "logs" / "infer.log"
    text = infer_log.read_text(errors="replace") if infer_log.exists() else ""
    for key, pattern in VLLM_LINES.items():
        found = re.findall(pattern, text)
        row[key] = float(found[-1]) if found else None
    metrics = run / "out" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    peaks = [r["memory/peak_gb"] for r in rows if "memory/peak_gb" in r]
    kls = [r["mismatch_kl"] for r in rows if "mismatch_kl" in r]
    row["trainer_peak_gib"] = max(peaks) if peaks else None
    row["mismatch_kl"] = kls[-1] if kls else None
    row["shared"] = "base weights shared with vLLM" in out
    return row


def fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


SECTION = "Co-located GRPO: Llama-3.1-8B shape at 20k context on one GPU (issue 28)"


def write_section(path: Path, lines: list[str]) -> None:
    """Replace (or add) the `SECTION` of `path` (sections start with `## `), keeping the rest as it is."""
    text = path.read_text() if path.exists() else "# GPU benchmarks\n"
    intro, *parts = text.split("\n## ")
    kept = [p for p in parts if p.split("\n", 1)[0].strip() != SECTION]
    body = "\n".join([SECTION, "", *lines]).rstrip() + "\n"
    path.write_text("\n## ".join([intro.rstrip() + "\n", *[p.rstrip() + "\n" for p in kept], body]))


def report(rows: list[dict], args: argparse.Namespace, device: str) -> list[str]:
    lines = [f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {device}; `python bench/colocate_8b.py "
             f"{' '.join(sys.argv[1:])}`; layers {args.layers or 32}, prompt {args.prompt_chars} chars + up to "
             f"{args.max_tokens} tokens, {args.rollouts} rollouts, {args.steps} steps. Target: nvidia-smi peak "
             f"<= 40 GB.", "",
             "| variant | exit | base shared | nvidia-smi peak (GB) | <= 40 GB | vLLM weights (GiB) | vLLM KV cache "
             "(GiB) | trainer peak (GiB) | mismatch KL | wall (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['exit']} | {'yes' if r['shared'] else 'no'} | {r['smi_peak_gb']:.1f} | "
                     f"{'yes' if r['smi_peak_gb'] <= 40 and r['exit'] == 0 else 'no'} | {fmt(r['weights_gib'])} | "
                     f"{fmt(r['kv_cache_gib'])} | {fmt(r['trainer_peak_gib'])} | {fmt(r['mismatch_kl'], '.2e')} | "
                     f"{r['seconds']:.0f} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["shared", "own"])
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 32, the real model's)")
    ap.add_argument("--prompt-chars", type=int, default=16000, help="reverse-text prompt length (characters)")
    ap.add_argument("--max-tokens", type=int, default=4096, help="completion tokens (prompt + this ~ 20k)")
    ap.add_argument("--rollouts", type=int, default=8, help="rollouts per prompt (one prompt per step)")
    ap.add_argument("--steps", type=int, default=2, help="GRPO steps per variant")
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True, help="vLLM without CUDA graphs")
    ap.add_argument("--work", default="/tmp/colocate_8b", help="model and run directories")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per variant")
    ap.add_argument("--out", default=str(REPO / "bench" / "GPU.md"))
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("colocate_8b: needs an NVIDIA GPU (co-location with CUDA IPC)", file=sys.stderr)
        return 2
    spec = {**LLAMA_3_1_8B, **({"num_hidden_layers": args.layers} if args.layers else {})}
    root = Path(args.work)
    model = build_model(root / f"llama-3.1-8b-shape-{spec['num_hidden_layers']}l", args.layers)
    device = torch.cuda.get_device_name(0)
    saved = root / "rows.json"  # rows of earlier invocations (one variant per command fits a 10-minute limit)
    by_variant = {r["variant"]: r for r in (json.loads(saved.read_text()) if saved.exists() else [])}
    rows = []
    for variant in args.variants:
        rows.append(run_variant(root, model, variant, args, spec))
        print(json.dumps(rows[-1]), flush=True)
        by_variant[variant] = rows[-1]
        saved.write_text(json.dumps(list(by_variant.values())))
    lines = report([by_variant[v] for v in VARIANTS if v in by_variant], args, device)
    write_section(Path(args.out), lines)
    print("\n".join(lines))
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
