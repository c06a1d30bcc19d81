"""Rollout-side probe: the bench's rollout request pattern against vLLM servers started as `tidal grpo` starts them
for the bench's co-located run (bundled example infer.yaml, merged-weight reloads on CPU: `weight_reload`, vLLM's
OpenMP threads on core 0 through VLLM_CPU_OMP_THREADS_BIND), one server per variant, all up at once, rounds
interleaved (variant order rotates every round) so that machine noise hits every variant alike.

One round = what the orchestrator sends per step: 8 prompts (reverse-text env) x one /v1/completions request each
with n=16, max_tokens 128, temperature 1, top_p 1, top_k -1, logprobs 0, return_token_ids, skip_special_tokens,
all 8 in flight at once. Every variant gets the same prompts in a round. Reported per variant: wall time per
round, generated tokens, tokens/s, and wall time / longest completion (~ time per decode step).

    PYTHONPATH=src python bench/rollout_probe.py --variants base,nolora --rounds 8 [--busy-core 1]

A variant is a name from VARIANTS (infer.yaml updates, extra vLLM args, extra env, core pinning of the whole
server), several joined by `+` (merged: `nolora+nostats`), or `name=--flag,--flag2 value` for ad-hoc vLLM flags
on top of the base. `base` is the bench's co-located server as tidal started it before bench/ROLLOUT.md's change
(the example infer.yaml: LoRA on, vLLM engine stats on); `colocate` is what `tidal grpo` derives now.
`--fixed-len` (ignore_eos) is a lower-variance proxy, not the bench's workload. Results: bench/ROLLOUT.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "scripts"))
import harness  # noqa: E402 - the benches' and checks' one harness (tidal.procs)

# name -> (infer.yaml updates, extra vLLM args, extra env, taskset cores for the whole server or None)
VARIANTS: dict[str, tuple[dict[str, Any], list[str], dict[str, str], str | None]] = {
    "base": ({}, [], {}, None),  # infer.yaml as it is (LoRA on, engine stats on): tidal's co-located server before
    "colocate": ({}, [], {}, None),  # the infer config `tidal grpo` derives now (LoRA off, stats off on CPU)
    "base2": ({}, [], {}, None),  # a second identical server: the noise floor between two servers
    "nolora": ({"enable_lora": False}, [], {}, None),
    "nolora-eager": ({"enable_lora": False, "enforce_eager": True}, [], {}, None),
    "pin0": ({}, [], {}, "0"),
    "async": ({}, ["--async-scheduling"], {}, None),
    "pin1": ({}, [], {}, "1"),  # API server + engine core (and the worker until it binds itself) on core 1
    "seqs64": ({}, ["--max-num-seqs", "64"], {}, None),
    "batched8k": ({}, ["--max-num-batched-tokens", "8192"], {}, None),
    "noprefix": ({"enable_prefix_caching": False}, [], {}, None),
    "nostats": ({"log_stats": False}, [], {}, None),
    "inproc": ({}, ["--distributed-executor-backend", "uni"], {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, None),
}


def server_cmd(name: str, port: int) -> tuple[list[str], dict[str, str], dict[str, Any]]:
    from tidal.config.infer import InferConfig
    from tidal.config.load import read_yaml
    from tidal.inference.backends.vllm.server import vllm_argv, vllm_env

    upd: dict[str, Any] = {}
    extra: list[str] = []
    env_add: dict[str, str] = {}
    pin: str | None = None
    if "=" in name:
        name, flags = name.split("=", 1)
        extra = [a for f in flags.split(",") for a in f.split(" ") if a]
    else:  # `a+b`: the variants' settings merged
        for part in name.split("+"):
            u, e, v, p = VARIANTS[part]
            upd, extra, env_add, pin = {**upd, **u}, extra + e, {**env_add, **v}, p or pin
    ex = REPO / "src" / "tidal" / "examples" / "reverse_text"
    raw = read_yaml(ex / "infer.yaml")
    if name.split("+")[0] == "colocate":  # what `tidal grpo` derives now for a 2-core CPU machine
        from tidal.colocate.derive import Machine, derive_colocate
        from tidal.config import OrchConfig, TrainConfig

        co = derive_colocate(TrainConfig(**read_yaml(ex / "train.yaml")), InferConfig(**raw),
                             OrchConfig(**read_yaml(ex / "orch.yaml")), Machine(cores=(0, 1)))
        raw = co.infer.model_dump()
    # base: the bench's co-located server before enable_lora/log_stats were derived (merged reloads on CPU)
    cfg = InferConfig(**{**raw, "port": port, "weight_reload": True, **upd})
    argv = vllm_argv(cfg) + extra
    env = vllm_env(cfg)
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0"  # split_cores on 2 cores: vLLM on core 0, trainer on core 1
    env.update(env_add)
    if pin is not None:
        argv = ["taskset", "-c", pin, *argv]
    return argv, env, {"infer": cfg.model_dump(), "extra": extra, "env": env_add, "pin": pin}


def busy_loop(core: int) -> None:  # the trainer's stand-in: one thread of float32 matmuls on `core`
    os.sched_setaffinity(0, {core})
    import torch

    torch.set_num_threads(1)
    a = torch.randn(512, 512)
    while True:
        a = torch.tanh(a @ a)


async def one_round(urls: dict[str, str], prompts: list[list[int]], order: list[str], args: argparse.Namespace,
                    model: str) -> dict[str, dict[str, float]]:
    import httpx

    out: dict[str, dict[str, float]] = {}
    async with httpx.AsyncClient(timeout=600) as http:
        for name in order:
            async def one(ids: list[int], url: str = urls[name]) -> list[int]:
                r = await http.post(f"{url}/completions", json={
                    "model": model, "prompt": ids, "n": args.n, "max_tokens": args.max_tokens, "temperature": 1.0,
                    "top_p": 1.0, "top_k": -1, "logprobs": 0, "return_token_ids": True, "skip_special_tokens": True,
                    **({"ignore_eos": True} if args.fixed_len else {})})
                r.raise_for_status()
                ch = r.json()["choices"]
                assert all(len(c["logprobs"]["token_logprobs"]) == len(c["token_ids"]) for c in ch)
                return [len(c["token_ids"]) for c in ch]

            t = time.monotonic()
            lens = [x for ls in await asyncio.gather(*(one(p) for p in prompts)) for x in ls]
            dt = time.monotonic() - t
            out[name] = {"s": dt, "tokens": sum(lens), "max_len": max(lens), "tok_s": sum(lens) / dt,
                         "ms_per_step": 1000 * dt / max(lens)}
    return out


def summarize(names: list[str], rows: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Per variant the medians over the timed rounds (printed), and each later variant against the first."""
    summary: dict[str, dict[str, Any]] = {}
    for n in names:
        s = [row[n]["s"] for row in rows]
        tok = [row[n]["tok_s"] for row in rows]
        ms = [row[n]["ms_per_step"] for row in rows]
        summary[n] = {"median_s": statistics.median(s), "median_tok_s": statistics.median(tok),
                      "median_ms_per_step": statistics.median(ms), "s": s, "tok_s": tok, "ms_per_step": ms}
        print(f"{n:>14}: median {statistics.median(s):.3f} s/round, {statistics.median(tok):.0f} tok/s, "
              f"{statistics.median(ms):.1f} ms/step | s: {' '.join(f'{x:.2f}' for x in s)}")
    if len(names) > 1:
        b = names[0]
        for n in names[1:]:
            ratios = [row[b]["ms_per_step"] / row[n]["ms_per_step"] for row in rows]
            print(f"{n} vs {b}: per-round speedup (ms/step ratio) median {statistics.median(ratios):.3f}, "
                  f"min {min(ratios):.3f}, max {max(ratios):.3f}; round-time ratio median "
                  f"{statistics.median([row[b]['s'] / row[n]['s'] for row in rows]):.3f}")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="base,nolora")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=8900)
    ap.add_argument("--busy-core", type=int, default=None, help="keep this core busy (the trainer's stand-in)")
    ap.add_argument("--fixed-len", action="store_true", help="a proxy with less variance (not the bench's "
                    "workload): ignore_eos, so every completion is max_tokens long")
    ap.add_argument("--out", default=None, help="JSON file for the raw figures")
    args = ap.parse_args()

    import httpx

    from tidal.envs import make_env

    names = args.variants.split(";") if ";" in args.variants else args.variants.split(",")
    work = Path(tempfile.mkdtemp(prefix="rollout-probe-"))
    procs: dict[str, harness.Child] = {}
    urls, meta = {}, {}
    busy = None
    try:
        for i, name in enumerate(names):  # one at a time: their start-ups would fight over the cores
            argv, env, meta[name] = server_cmd(name, args.port + i)
            procs[name] = harness.start(name, argv, work / f"{i}.log", env=env)
            root = f"http://127.0.0.1:{args.port + i}"
            t = time.monotonic()
            try:
                harness.wait_ready(procs[name], f"{root}/health", 900, poll_s=0.2)
            except harness.NotHealthy as exc:
                raise RuntimeError(f"{name}: {exc}; see {work / f'{i}.log'}") from None
            urls[name] = f"{root}/v1"
            print(f"[{time.strftime('%H:%M:%S')}] {name} ready in {time.monotonic() - t:.1f} s "
                  f"(log {work / f'{i}.log'})", flush=True)
        if args.busy_core is not None:
            import multiprocessing as mp

            busy = mp.get_context("spawn").Process(target=busy_loop, args=(args.busy_core,), daemon=True)
            busy.start()
        task, model = make_env("reverse-text", {}), "tidal:tiny-reverse"
        root0 = urls[names[0]].removesuffix("/v1")
        rows: list[dict[str, dict[str, float]]] = []
        for r in range(args.warmup + args.rounds):
            rng = random.Random(1000 + r)
            prompts = [httpx.post(f"{root0}/tokenize", json={
                "model": model, "messages": task.sample(rng).prompt, "add_generation_prompt": True,
                "add_special_tokens": False}).json()["tokens"] for _ in range(args.prompts)]
            order = names[r % len(names):] + names[:r % len(names)]
            res = asyncio.run(one_round(urls, prompts, order, args, model))
            tag = "warm-up" if r < args.warmup else f"round {r - args.warmup + 1}"
            print(f"[{time.strftime('%H:%M:%S')}] {tag}: " + "  ".join(
                f"{n} {res[n]['s']:.2f}s {res[n]['tokens']:.0f}tok maxlen {res[n]['max_len']:.0f} "
                f"{res[n]['ms_per_step']:.1f}ms/step" for n in names), flush=True)
            if r >= args.warmup:
                rows.append(res)
        print(f"\nload avg: {os.getloadavg()}")
        summary = summarize(names, rows)
        if args.out:
            Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows, "summary": summary}, indent=1))
    finally:
        if busy is not None:
            busy.terminate()
        harness.stop(*procs.values())


if __name__ == "__main__":
    main()
