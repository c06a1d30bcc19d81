"""The trainer's step against this machine's matmul rate (issue 68, the <= 6 s per step goal): how much of a `tidal
grpo` run's training time per step the model's own matmuls need at that step's shapes, timed here, and what is left.

For each step of a run (its `metrics.jsonl`: `processed_tokens`, the tokens the trainer's forward runs after prompt
sharing, and `tokens`, its loss tokens) this times, with torch's threads on this machine, the matmuls every
implementation of that training step has to run for a LoRA policy: per decoder layer the frozen base projections
(q, k, v, o, gate, up, down for a Llama-shaped layer) forward, and backward their input gradient (one matmul of the
same size each: the frozen weights get no gradient), over `processed_tokens`; and the LM head over the loss tokens,
forward and its input gradient. Each layer's weights are distinct tensors, so the timing pays the memory traffic a
real step pays. Not counted: LoRA's rank-r matmuls, attention, norms, activations, the log-softmax; a micro-batch
the trainer skips (a group whose rewards all agree: forward only) is counted with its backward. So a step with no
skipped micro-batch (`micro_batches/skipped` 0) gets a lower bound; the others slightly more than the matmuls they
ran. Printed per step: the floor, `train_time_s`, their ratio, and the matmuls' rate (GFLOP/s).

    flock /tmp/tidal-heavy.lock python bench/compute_floor.py RUN_DIR [--steps 2,3,15] [--repeats 3]

Every result is also one line `COMPUTE_FLOOR {json}` on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any


def dims(run: Path) -> dict[str, int]:
    """The run's model dimensions (its configs/train.yaml `model`, resolved as tidal resolves it)."""
    from tidal.config.load import load_config
    from tidal.config.train import TrainConfig
    from tidal.models.config import model_config, text_config

    model = load_config(TrainConfig, run / "configs" / "train.yaml", {}).model
    c = text_config(model_config(model))
    heads, hidden = int(c["num_attention_heads"]), int(c["hidden_size"])
    head_dim = int(c.get("head_dim") or hidden // heads)
    return {"hidden": hidden, "intermediate": int(c["intermediate_size"]), "layers": int(c["num_hidden_layers"]),
            "q": heads * head_dim, "kv": int(c.get("num_key_value_heads") or heads) * head_dim,
            "vocab": int(c["vocab_size"])}


def projections(d: dict[str, int]) -> list[tuple[int, int]]:
    """(in, out) of one Llama-shaped decoder layer's base projections."""
    h, i = d["hidden"], d["intermediate"]
    return [(h, d["q"]), (h, d["kv"]), (h, d["kv"]), (d["q"], h), (h, i), (h, i), (i, h)]


def timed(fn: Any, repeats: int) -> float:
    """The fastest of `repeats` calls of `fn`, seconds."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def floor(d: dict[str, int], tokens: int, loss_tokens: int, repeats: int) -> dict[str, float]:
    """Seconds and FLOPs of the base matmuls of one LoRA training step over `tokens` (forward + input gradient) and
    of the LM head over `loss_tokens` (the same two), timed with distinct weights per layer."""
    import torch

    torch.manual_seed(0)
    with torch.no_grad():
        layers = [[torch.randn(o, i) * 0.02 for i, o in projections(d)] for _ in range(d["layers"])]
        head = torch.randn(d["vocab"], d["hidden"]) * 0.02
        xs = {n: torch.randn(tokens, n) for n in {i for i, _ in projections(d)} | {o for _, o in projections(d)}}
        h = torch.randn(loss_tokens, d["hidden"])
        g = torch.randn(loss_tokens, d["vocab"])

        def body() -> None:
            for ws in layers:
                for w in ws:
                    torch.nn.functional.linear(xs[w.shape[1]], w)  # forward: (T, in) x (in, out)
                    xs[w.shape[0]].mm(w)  # input gradient: (T, out) x (out, in)

        def lm_head() -> None:
            torch.nn.functional.linear(h, head)
            g.mm(head)

        body_s, head_s = timed(body, repeats), timed(lm_head, repeats)
    flops = 4.0 * (tokens * sum(i * o for i, o in projections(d)) * d["layers"] + loss_tokens * d["vocab"]
                   * d["hidden"])
    return {"body_s": body_s, "head_s": head_s, "floor_s": body_s + head_s, "gflops": flops / 1e9,
            "gflop_per_s": flops / 1e9 / (body_s + head_s)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a `tidal grpo --output-dir` (metrics.jsonl, configs/train.yaml)")
    ap.add_argument("--steps", default=None, help="comma-separated steps (default: every step)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import torch

    rows = [json.loads(line) for line in (args.run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if args.steps:
        keep = {int(s) for s in args.steps.split(",")}
        rows = [r for r in rows if r["step"] in keep]
    d = dims(args.run)
    print(f"{args.run}: {d}; torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    print("| step | processed tokens | loss tokens | skipped micro-batches | matmul floor s (body + head) | "
          "train_time_s | train / floor | GFLOP | matmul GFLOP/s |")
    print("|---" * 9 + "|")
    for r in rows:
        f = floor(d, int(r["processed_tokens"]), int(r["tokens"]), args.repeats)
        print(f"| {r['step']} | {r['processed_tokens']} | {r['tokens']} | {r.get('micro_batches/skipped', 0)} | "
              f"{f['floor_s']:.2f} ({f['body_s']:.2f} + {f['head_s']:.2f}) | {r['train_time_s']:.2f} | "
              f"{r['train_time_s'] / f['floor_s']:.2f} | {f['gflops']:.0f} | {f['gflop_per_s']:.0f} |", flush=True)
        print("COMPUTE_FLOOR " + json.dumps({"run": str(args.run), "step": r["step"], **f,
                                             "train_time_s": r["train_time_s"]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
