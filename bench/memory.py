"""`make bench-memory`: peak memory of one training micro-batch, full logits vs chunked logprobs, with and without
activation checkpointing, in one run.

The policy is Qwen3-0.6B-shaped, random init from a transformers `Qwen3Config` (vocabulary 151,936, hidden 1024,
16 heads of 128, 8 KV heads, MLP 3072, tied embeddings; nothing downloaded) with LoRA r16 on all linear layers, as
`tidal grpo-train` builds it. The micro-batch is one packed row of T tokens: samples of 1024 tokens (256 prompt +
768 completion), `position_ids` restarting per sample. One micro-batch = logprobs at temperature 1 (the trainer's
`forward_logprobs_entropy`, loss mask given) -> the GRPO loss (`policy_loss`, `loss_type: grpo`) -> backward.
Modes:

- `body only`: the floor. The same decoder forward/backward with a trivial loss on the final hidden states, no
  lm_head at all;
- `full logits`: the old path (`logprob_chunk_size: 0`), the whole (T, vocab) logits;
- `chunked`: `logprob_chunk_size` positions at a time (default: train.yaml's default);

each without and with `gradient_checkpointing`. Every configuration runs in a fresh subprocess.

Measured: on CPU the peak resident set size during the micro-batch minus the resident size just before it (the
peak is reset through /proc/self/clear_refs; large blocks are mmapped, see `MMAP_THRESHOLD`); on CUDA
`torch.cuda.max_memory_allocated` minus the allocation before it. "logprob step adds" is a configuration's peak
minus the `body only` peak at the same length and checkpointing. Ratios are to `full logits` without
checkpointing at the same length. A configuration that would need more than the memory limit (`--limit-gib`, or
what the machine has free) is reported as not fitting: on CPU the child gets an address-space limit, so it fails
cleanly instead of pushing a shared machine into swap or the OOM killer. On CPU the decoder has fewer layers
(`--layers`, 2 by default, to keep the run near 10 minutes on two cores; 28 on CUDA, as Qwen3-0.6B): the logits
part does not depend on it, the activations do. Times are wall seconds of the micro-batch, indicative only (a
shared machine).

Writes `bench/MEMORY.md`: one section per device kind, a run replacing its own device's section.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import re
import resource
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "scripts"))
import harness  # noqa: E402 - the benches' and checks' one harness (tidal.procs)

GIB = 1024**3
SAMPLE, PROMPT = 1024, 256
MMAP_THRESHOLD = 4 * 1024**2
"""glibc serves allocations of this size and more with mmap and unmaps them at free, so the RSS follows the live
tensors. Left to its dynamic threshold (raised after each large free, up to 32 MiB), glibc keeps freed blocks in
its heaps and the peak of identical runs varies by ~0.5 GiB."""
MODES = ("body only", "full logits", "chunked")
QWEN3_0_6B: dict[str, Any] = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, tie_word_embeddings=True, num_hidden_layers=28)


# --- child: one configuration ---------------------------------------------------------------------------------------

def proc_status(key: str) -> int:
    """A /proc/self/status size (VmRSS, VmHWM, VmSize) in bytes."""
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    assert match, key
    return int(match.group(1)) * 1024


def build_policy(layers: int, checkpointing: bool, device: Any, dtype: Any) -> Any:
    """The Qwen3-0.6B-shaped LoRA policy in training mode, the way `load_policy` builds it."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tidal.config.train import TrainConfig
    from tidal.trainer.model.load import add_lora, enable_gradient_checkpointing

    torch.manual_seed(0)
    cfg = Qwen3Config(**(QWEN3_0_6B | {"num_hidden_layers": layers}))
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    if checkpointing:
        enable_gradient_checkpointing(model)
    model = add_lora(model, TrainConfig(model="unused", lora_rank=16, lora_alpha=32))
    model.train()
    return model


def micro_batch(tokens: int, device: Any) -> dict[str, Any]:
    """One packed row of `tokens` tokens: samples of SAMPLE tokens, loss on all but the first PROMPT of each."""
    import torch

    gen = torch.Generator().manual_seed(1)
    n = -(-tokens // SAMPLE)
    pos = torch.arange(SAMPLE).repeat(n)[:tokens][None]  # (1, T) restarting per sample
    seq = torch.arange(n).repeat_interleave(SAMPLE)[:tokens][None]
    mask = pos >= PROMPT
    ids = torch.randint(0, QWEN3_0_6B["vocab_size"], (1, tokens), generator=gen)
    adv = torch.randn(n, generator=gen)[seq] * mask
    return {k: v.to(device) for k, v in dict(ids=ids, pos=pos, seq=seq, mask=mask, adv=adv).items()}


def step(model: Any, mb: dict[str, Any], mode: str, chunk: int) -> None:
    """Forward logprobs (or the body alone) -> GRPO loss -> backward."""
    import torch

    from tidal.config.train import LossConfig
    from tidal.trainer.step.logprobs import forward_logprobs_entropy, split_head
    from tidal.trainer.step.loss import LossInputs, LossScale, policy_loss

    if mode == "body only":
        head = split_head(model)
        assert head is not None
        hidden = head.body(input_ids=mb["ids"], position_ids=mb["pos"], use_cache=False).last_hidden_state
        (hidden[:, :-1][mb["mask"][:, 1:]].float().sum(-1) * 1e-3).sum().backward()
        return
    lp, ent = forward_logprobs_entropy(model, mb["ids"], mb["pos"], 1.0, loss_mask=mb["mask"],
                                       chunk_size=0 if mode == "full logits" else chunk)
    noise = torch.randn(lp.shape, generator=torch.Generator().manual_seed(2)).to(lp.device) * 0.01
    inputs = LossInputs(logprobs=lp, old_logprobs=lp.detach(), inference_logprobs=lp.detach() + noise,
                        advantages=mb["adv"], loss_mask=mb["mask"], seq_ids=mb["seq"], entropy=ent)
    scale = LossScale(step_tokens=float(mb["mask"].sum()), step_sequences=int(mb["seq"].max()) + 1,
                      micro_batches=1, max_completion_len=SAMPLE - PROMPT)
    loss, _ = policy_loss(inputs, LossConfig(loss_type="grpo"), scale)
    loss.backward()


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure one configuration (see the module doc); returns its peak and time, or that it does not fit."""
    import torch

    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(spec["threads"])
    model = build_policy(spec["layers"], spec["ckpt"], device, torch.bfloat16 if cuda else torch.float32)
    mb = micro_batch(spec["tokens"], device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap pages back to the system: RSS = what is in use
        limit = proc_status("VmSize") + int(spec["limit_gib"] * GIB)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM, the peak RSS, to the current RSS
        before = proc_status("VmRSS")
    t0 = time.perf_counter()
    try:
        step(model, mb, spec["mode"], spec["chunk"])
    except (RuntimeError, MemoryError) as exc:  # CPU: the address-space limit; CUDA: out of memory
        if "memory" not in str(exc).lower() and not isinstance(exc, MemoryError):
            raise
        return {"fits": False}
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else proc_status("VmHWM")
    return {"fits": True, "peak_gib": (peak - before) / GIB, "seconds": seconds}


# --- parent: all configurations, the table --------------------------------------------------------------------------

def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """`child(spec)` in a fresh interpreter."""
    env = os.environ | {"OMP_NUM_THREADS": str(spec["threads"]), "TOKENIZERS_PARALLELISM": "false",
                        "HF_HUB_OFFLINE": "1", "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    return harness.run_json([sys.executable, __file__, "--child", json.dumps(spec)], 1800, env=env,
                            what=f"configuration {spec}")


def free_gib() -> float:
    """Memory the machine has available now (MemAvailable), in GiB."""
    text = Path("/proc/meminfo").read_text()
    match = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) * 1024 / GIB if match else float("inf")


def predicted_misfit(rows: list[dict[str, Any]], spec: dict[str, Any]) -> dict[str, Any] | None:
    """CPU: skip a configuration whose shorter run (same mode and checkpointing), scaled linearly in tokens,
    already exceeds the limit (or did not fit): it would only take minutes to fail."""
    if spec["device"] != "cpu":
        return None
    for r in rows[::-1]:
        if (r["mode"], r["ckpt"]) == (spec["mode"], spec["ckpt"]) and r["tokens"] < spec["tokens"]:
            if not r["fits"]:
                return {"fits": False, "estimated_gib": None}
            estimate = r["peak_gib"] * spec["tokens"] / r["tokens"]
            return {"fits": False, "estimated_gib": estimate} if estimate > spec["limit_gib"] else None
    return None


def measure(args: argparse.Namespace, device: str) -> list[dict[str, Any]]:
    """Every (tokens, checkpointing, mode) configuration, each in its own child."""
    rows: list[dict[str, Any]] = []
    for tokens in args.tokens:
        for ckpt in (False, True):
            for mode in MODES:
                limit = min(args.limit_gib, free_gib() - 2.0) if device == "cpu" else 0.0
                spec = dict(device=device, tokens=tokens, ckpt=ckpt, mode=mode, chunk=args.chunk,
                            layers=args.layers, threads=args.threads, limit_gib=limit)
                res = predicted_misfit(rows, spec) or run_child(spec)
                rows.append(spec | res)
                shown = f"{res['peak_gib']:.2f} GiB, {res['seconds']:.1f} s" if res["fits"] else "does not fit"
                print(f"{tokens:>5} tokens  checkpointing {'on ' if ckpt else 'off'}  {mode:<12} {shown}",
                      flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown table: peak, logprob step (peak - body only), ratio to full logits without checkpointing."""
    out = ["| tokens per row | gradient checkpointing | logprobs | peak (GiB) | logprob step adds (GiB) | "
           "ratio to full logits, no checkpointing | time (s) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        same = [q for q in rows if q["tokens"] == r["tokens"]]
        floor = next(q for q in same if q["ckpt"] == r["ckpt"] and q["mode"] == "body only")
        base = next(q for q in same if not q["ckpt"] and q["mode"] == "full logits")
        mode = f"chunked ({r['chunk']})" if r["mode"] == "chunked" else r["mode"]
        if not r["fits"]:
            est = r.get("estimated_gib")
            why = f" (about {est:.0f} GiB scaled from the shorter row; not run)" if est else ""
            out.append(f"| {r['tokens']} | {'on' if r['ckpt'] else 'off'} | {mode} | does not fit in "
                       f"{r['limit_gib']:.0f} GiB{why} | | | |")
            continue
        adds = "" if r["mode"] == "body only" or not floor["fits"] else f"{r['peak_gib'] - floor['peak_gib']:.2f}"
        ratio = f"{r['peak_gib'] / base['peak_gib']:.2f}" if base["fits"] else "(baseline does not fit)"
        out.append(f"| {r['tokens']} | {'on' if r['ckpt'] else 'off'} | {mode} | {r['peak_gib']:.2f} | {adds} | "
                   f"{ratio} | {r['seconds']:.1f} |")
    return out


def write_section(path: Path, device_kind: str, lines: list[str]) -> None:
    """Replace (or add) this device kind's section of `path`, keeping the other devices' sections."""
    title = "# Trainer memory: one micro-batch, full logits vs chunked logprobs, with and without checkpointing"
    sections: dict[str, str] = {}
    if path.exists():
        for part in path.read_text().split("\n## ")[1:]:
            sections[part.split("\n", 1)[0].strip()] = "## " + part.rstrip() + "\n"
    sections[device_kind] = "\n".join([f"## {device_kind}", "", *lines]) + "\n"
    intro = (f"{title}\n\nWritten by `make bench-memory` (bench/memory.py; its docstring says what is measured). "
             "One section per device kind; a run replaces its own.\n")
    path.write_text(intro + "\n" + "\n".join(sections[k] for k in sorted(sections)))


def main() -> int:
    from tidal.config.train import DEFAULT_LOGPROB_CHUNK_SIZE

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="tokens per row (default 2048 4096 8192)")
    ap.add_argument("--chunk", type=int, default=DEFAULT_LOGPROB_CHUNK_SIZE, help="logprob_chunk_size")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 2 on CPU, 28 on CUDA)")
    ap.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 2), help="CPU threads")
    ap.add_argument("--limit-gib", type=float, default=12.0,
                    help="CPU: memory one configuration may take (the machine is shared)")
    ap.add_argument("--out", default=str(REPO / "bench" / "MEMORY.md"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.layers = args.layers or (28 if device == "cuda" else 2)
    args.tokens = args.tokens or [2048, 4096, 8192]
    t0 = time.monotonic()
    rows = measure(args, device)
    what = (torch.cuda.get_device_name() if device == "cuda" else f"{platform.machine()} CPU, {args.threads} threads")
    lines = [f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {what} (torch {torch.__version__}) in "
             f"{time.monotonic() - t0:.0f} s; command: `python bench/memory.py {' '.join(sys.argv[1:])}`.", "",
             f"Qwen3-0.6B shape with **{args.layers} decoder layers**"
             f"{' (the real model has 28)' if args.layers != 28 else ''}, "
             f"{'float32' if device == 'cpu' else 'bfloat16'}, LoRA r16 on all linear layers; one packed row of "
             f"samples of {SAMPLE} tokens ({PROMPT} prompt + {SAMPLE - PROMPT} completion); GRPO loss; "
             f"{'peak RSS' if device == 'cpu' else 'peak torch.cuda.max_memory_allocated'} during the micro-batch "
             "minus before it. \"logprob step adds\" = peak - `body only` peak (same length and checkpointing); with "
             "checkpointing the chunked buffers are gone before the decoder's own backward peak, so the step can "
             "add nothing to the peak.",
             "", *table(rows)]
    write_section(Path(args.out), "CUDA" if device == "cuda" else "CPU", lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
