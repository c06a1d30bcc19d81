"""vLLM start-up time of `tidal grpo-infer` on the bundled model, with a phase breakdown and a throughput check.

Each variant starts the server as a user does, `python -m tidal.cli grpo-infer <example infer.yaml>`
plus the variant's overrides (so tidal's own start-up is included), stamps every log line with the time since the start,
polls `/health` every 50 ms, then sends a generation burst (`--requests` completions of `--tokens` tokens each,
all in flight, EOS ignored) twice and reports tokens/s of both bursts (the first one may include lazy
warm-up). Variants run in rounds, alternating (A B C A B C ...), because the machine is shared and noisy; the
load average is recorded with every run.

Phases (from the log lines of tidal and vLLM 0.32's processes):
  tidal          start -> `tidal grpo-infer` execs vLLM (config parsing, checks; with LoRA, resolving the LoRA
                 targets on the meta model imports torch + transformers)
  api_import     -> the API server prints its arguments (python + vllm imports, argument parsing)
  engine_start   -> "Initializing a V1 LLM engine" (the engine-core process spawned and imported vllm)
  worker_start   -> "Starting to load model" (mp executor: the worker process spawned, imported vllm, set up
                 gloo; uni executor: the worker built inside the engine core, well under a second)
  model_load     -> "Loading weights took" (model built, safetensors read)
  engine_init    -> "init engine (...) took" (LoRA wrappers, KV-cache allocation, compile / warm-up)
  api_up         -> "Application startup complete" (the API server builds its routes and tokenizer state)
  ready          -> first `/health` 200

With `--grpo-steps N` each round also runs every variant as `tidal grpo` (bundled example, N steps) and reports
vLLM ready (with the launcher's phases), the launcher's start-up milestones (orchestrator and trainer ready, first
batch), the first step done (first metrics row, since `tidal grpo` started), the whole run, rollout and step time,
and the step-1 mismatch KL. Variant `pool` runs `tidal grpo` against a warm pool started (untimed) before it
(`tidal serve`). Variant `before` is the start-up before issue 37 (three vLLM processes, orchestrator
and trainer after `/health`); `sequential` only the latter.

Run: `PYTHONPATH=src python bench/vllm_startup.py [--rounds 2] [--variants default,mp] [--grpo-steps 6] [--write]`;
`--write` replaces bench/STARTUP.md's generated table with this run's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


EXAMPLE = REPO / "src/tidal/examples/reverse_text/infer.yaml"
OUT = REPO / "bench/STARTUP.md"

sys.path.insert(0, str(REPO / "src"))
from tidal.colocate.supervise import STARTUP_PHASES as PHASES  # noqa: E402  (the launcher's log line times the same phases)

sys.path.insert(0, str(REPO / "scripts"))
import harness  # noqa: E402 - the benches' and checks' one harness (tidal.procs)
from harness import free_port  # noqa: E402


@dataclass
class Variant:
    """A server configuration to time: `tidal grpo-infer` arguments and environment variables on top of the
    example's, and the tidal source tree that runs it."""

    name: str
    doc: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    src: str = str(REPO / "src")
    grpo_args: list[str] = field(default_factory=list)
    """More `tidal grpo` arguments (the `--grpo-steps` runs only; `tidal grpo-infer` does not take them)."""
    pool: bool = False
    """`tidal grpo` runs attach to a warm pool (`tidal serve`, docs/warm-pool.md) started for them beforehand, its
    start not timed: the first step of a run whose vLLM is already loaded (the reset to the base weights included)."""
    pool_args: list[str] = field(default_factory=list)
    """More `tidal serve` arguments (`--no-trainer`: vLLM kept, the trainer's base model not)."""
    fresh_caches: bool = False
    """Start as on a fresh machine (or after a reboot emptied /tmp): tidal's cache (the Inductor cache under it) and
    vLLM's (`VLLM_CACHE_ROOT`: model inspection, compile cache) are new empty directories for each run."""

    def environ(self, log_dir: Path) -> dict[str, str]:
        """The run's environment: this process's, the variant's `src` on PYTHONPATH and its variables (fresh caches:
        new empty ones)."""
        env = {**os.environ, "PYTHONPATH": self.src, "PYTHONUNBUFFERED": "1", **self.env}
        import tempfile

        if self.pool:  # the pool's state and lock in a directory of its own (not a pool the user runs), the
            from tidal.inference.backends.vllm.server import inductor_cache  # compile cache the shared one

            env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache()))
            env["TIDAL_CACHE"] = tempfile.mkdtemp(prefix=f"pool-{self.name}-", dir=log_dir)
            share_models(Path(env["TIDAL_CACHE"]))
        if self.fresh_caches:
            fresh = Path(tempfile.mkdtemp(prefix=f"caches-{self.name}-", dir=log_dir))
            env.update(TIDAL_CACHE=str(fresh / "tidal"), VLLM_CACHE_ROOT=str(fresh / "vllm"))
            env.pop("TORCHINDUCTOR_CACHE_DIR", None)
            share_models(fresh / "tidal")
        return env


def share_models(cache: Path) -> None:
    """The user's converted models (a real GGUF dequantized once, the wheels' files, their hashes) linked into the
    tidal cache `cache`: what `make setup-real` converts is kept; compile caches and a pool's state are not shared."""
    from tidal.models.sources.gguf import cache_root

    cache.mkdir(parents=True, exist_ok=True)
    for shared in ("gguf", "wheels", "hashes"):
        if (cache_root() / shared).is_dir():
            (cache / shared).symlink_to(cache_root() / shared)


VARIANTS: dict[str, Variant] = {v.name: v for v in [
    Variant("default", "`tidal grpo-infer` on the example infer.yaml (LoRA on), this checkout: on CPU the model worker "
            "runs inside the engine-core process (uni executor, OMP_NUM_THREADS as vLLM's mp worker gets it): "
            "2 vLLM processes"),
    Variant("mp", "the same with vLLM's mp executor (`--distributed-executor-backend mp` in extra_args: tidal then "
            "leaves the executor and OMP_NUM_THREADS alone): API server, engine core and worker, 3 vLLM processes, "
            "the start-up before the change", args=["--infer.extra_args", '["--distributed-executor-backend", "mp"]']),
    Variant("before", "the start-up before issue 37: vLLM's mp executor (3 vLLM processes) and, in `tidal grpo`, "
            "the orchestrator and trainer started once vLLM is healthy (`--startup sequential`)",
            args=["--infer.extra_args", '["--distributed-executor-backend", "mp"]'],
            grpo_args=["--startup", "sequential"]),
    Variant("sequential", "this checkout's vLLM start (in-engine worker), but the orchestrator and trainer started "
            "once vLLM is healthy (`tidal grpo --startup sequential`): what the overlap alone saves",
            grpo_args=["--startup", "sequential"]),
    Variant("uni-allcores", "uni executor with torch's default thread count (VLLM_CPU_OMP_THREADS_BIND=nobind: tidal "
            "leaves OMP_NUM_THREADS unset, so the engine core uses every core)",
            env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}),
    Variant("nolora", "LoRA off (vLLM then torch.compiles the model with inductor; infer aot_compile auto: a saved "
            "AOT model is loaded where one exists, else torch's compile caches serve the start)",
            args=["--infer.enable_lora", "false"]),
    Variant("nolora-mp", "LoRA off, mp executor", args=["--infer.enable_lora", "false", "--infer.extra_args",
                                                         '["--distributed-executor-backend", "mp"]']),
    Variant("nolora-aot", "LoRA off, infer aot_compile true (vLLM's AOT compile: the first start compiles and saves, "
            "later ones load it through tidal's aot_cpu patch; before it, every start compiled)",
            args=["--infer.enable_lora", "false", "--infer.aot_compile", "true"]),
    Variant("block32", "32-token KV blocks (infer block_size 32; vLLM-CPU's default is 128): the n completions of a "
            "prompt share its prefill but for the last partial block", args=["--infer.block_size", "32"]),
    Variant("nolora-eager", "LoRA off, enforce_eager (no torch.compile)",
            args=["--infer.enable_lora", "false", "--infer.enforce_eager", "true"]),
    Variant("pool", "a warm pool (`tidal serve`) started before the run and not timed; the run attaches to its vLLM, "
            "resets it to the base weights and starts no vLLM, and its trainer is forked from the pool's kept trainer "
            "(torch imported, base model loaded) (`tidal grpo` rows only)", pool=True),
    Variant("pool-vllm", "a warm pool that keeps vLLM only (`tidal serve --no-trainer`): the run's trainer imports "
            "torch and loads the model itself (`tidal grpo` rows only)", pool=True, pool_args=["--no-trainer"]),
    Variant("cold", "as on a fresh machine or after a reboot: empty compile and model-inspection caches (tidal's and "
            "vLLM's; issue 68; `make setup` fills them, so a user's first run is the default row); converted models "
            "kept (`make setup-real` converts them once)", fresh_caches=True),
    Variant("cold-eager", "empty caches, and vLLM eager (infer enforce_eager: nothing to compile; slower rollouts)",
            args=["--infer.enforce_eager", "true"], fresh_caches=True),
]}


@dataclass
class Run:
    variant: str
    ready_s: float
    phases: dict[str, float]
    burst_tok_s: list[float]
    load: tuple[float, float, float]
    processes: int


def count_family(pid: int) -> int:
    """Processes in the server's session (the API server and the engine processes it spawned)."""
    out = subprocess.run(["ps", "-o", "pid=", "-s", str(os.getsid(pid))], capture_output=True, text=True).stdout
    return len(out.split())


async def burst(base: str, n: int, tokens: int, model: str = "tidal:tiny-reverse") -> float:
    """Tokens/s of `n` concurrent completions of exactly `tokens` tokens (sampling at temperature 1, logprobs 1,
    as tidal's rollouts ask)."""
    body = {"model": model, "prompt": [1, 5, 9, 17, 33, 41, 3], "max_tokens": tokens,
            "temperature": 1.0, "logprobs": 1, "ignore_eos": True, "min_tokens": tokens}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=n)) as client:
        async def one(i: int) -> int:
            r = await client.post(f"{base}/v1/completions", json={**body, "seed": i})
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        start = time.monotonic()
        done = await asyncio.gather(*(one(i) for i in range(n)))
        return sum(done) / (time.monotonic() - start)


def time_start(variant: Variant, requests: int, tokens: int, log_dir: Path, infer: Path = EXAMPLE) -> Run:
    import yaml

    port = free_port()
    model = yaml.safe_load(infer.read_text())["model"]
    argv = [sys.executable, "-m", "tidal.cli", "grpo-infer", str(infer), "--infer.port", str(port),
            *variant.args]
    env = variant.environ(log_dir)
    log_path = log_dir / f"{variant.name}-{port}.log"
    marks: dict[str, float] = {}
    start = time.monotonic()
    def mark(line: str) -> None:  # each phase's first line, timed from the start
        t = time.monotonic() - start
        for name, pattern in PHASES:
            if name not in marks and re.search(pattern, line):
                marks[name] = t

    child = harness.start(variant.name, argv, log_path, env=env, on_line=mark)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            harness.wait_ready(child, f"{base}/health", 900, start, poll_s=0.05)
        except harness.NotHealthy as exc:
            raise RuntimeError(f"{variant.name}: {exc}; see {log_path}") from None
        ready = time.monotonic() - start
        load = os.getloadavg()
        processes = count_family(child.pid)
        rates = [asyncio.run(burst(base, requests, tokens, model)) for _ in range(4)]
    finally:
        harness.stop(child)
    phases, prev = {}, 0.0
    for name, _ in PHASES:
        if name in marks:
            phases[name] = marks[name] - prev
            prev = marks[name]
    phases["ready"] = ready - prev
    return Run(variant.name, ready, phases, rates, load, processes)


def fmt_run(r: Run) -> str:
    cells = [f"{r.phases[p]:.1f}" if p in r.phases else "-" for p, _ in PHASES]
    return (f"| {r.variant} | **{r.ready_s:.1f}** | " + " | ".join(cells) + f" | {r.phases['ready']:.2f} | "
            f"{r.processes} | {r.burst_tok_s[0]:.0f} / {statistics.median(r.burst_tok_s[1:]):.0f} | "
            f"{' '.join(f'{x:.2f}' for x in r.load)} |")


def table(runs: list[Run]) -> str:
    head = ("| variant | ready s | " + " | ".join(p for p, _ in PHASES) + " | health seen | procs | "
            "burst tok/s (1st / median of next 3) | load avg 1/5/15 |")
    sep = "|" + "---|" * (len(PHASES) + 6)
    lines = [head, sep, *(fmt_run(r) for r in runs), "", "Medians:", ""]
    for name in dict.fromkeys(r.variant for r in runs):
        mine = [r for r in runs if r.variant == name]
        steady = statistics.median(statistics.median(r.burst_tok_s[1:]) for r in mine)
        lines.append(f"- {name}: ready {statistics.median(r.ready_s for r in mine):.1f} s, steady burst "
                     f"{steady:.0f} tok/s ({len(mine)} runs)")
    return "\n".join(lines)


@dataclass
class GrpoRun:
    variant: str
    ready_s: float
    phases: str
    first_step_s: float
    total_s: float
    rollout_s: float
    step_s: float
    mismatch_kl: float
    load: float
    milestones: str = ""
    """The launcher's `first step done` line: orchestrator / trainer ready, first batch (s since vLLM started)."""
    last_step_s: float = math.nan
    """Median step time over the run's last 5 steps (s/step at the end of a run)."""
    out: str = ""
    """The run's output directory (metrics.jsonl: the per-step `timing/*` accounting)."""


def time_grpo(variant: Variant, steps: int, log_dir: Path, configs: list[str] | None = None,
              extra: list[str] | None = None) -> GrpoRun:
    """`tidal grpo` on the bundled example with the variant's overrides: launch to the launcher's `inference
    ready` line (and its phases), to the first metrics row (first step trained), to exit; the medians of rollout
    and step time over steps >= 3. `configs`: `--train/--infer/--orch` files (None: the bundled example); `extra`:
    more `tidal grpo` arguments for every variant (`--grpo-args`)."""
    import json
    import tempfile

    out = Path(tempfile.mkdtemp(prefix=f"grpo-{variant.name}-", dir=log_dir))
    port = free_port()
    argv = [sys.executable, "-m", "tidal.cli", "grpo", "--output-dir", str(out), "--orch.max_steps", str(steps),
            "--infer.port", str(port), *(configs or []), *(extra or []), *variant.args, *variant.grpo_args]
    env = variant.environ(log_dir)
    pool = start_pool(port, [*(configs or []), *variant.args, *variant.pool_args], env, out) if variant.pool else None
    metrics, first = out / "metrics.jsonl", float("nan")
    start = time.monotonic()
    child = harness.start(f"{variant.name}-grpo", argv, out / "launcher.log", env=env)
    try:
        while (code := child.poll()) is None:
            if math.isnan(first) and metrics.exists() and metrics.read_text().strip():
                first = time.monotonic() - start
            time.sleep(0.1)
        total = time.monotonic() - start  # the run's own exit (a pool's stop below is not the run's time)
    finally:
        harness.stop(child)
        if pool is not None:
            stop_pool(pool, env)
    if code != 0:
        raise RuntimeError(f"{variant.name}: tidal grpo exited {code}; see {out / 'launcher.log'}")
    text = (out / "launcher.log").read_text()
    ready = re.search(r"inference ready after ([0-9.]+) s(?: \(([^)]*) s\))?", text)
    told = re.search(r"first step done after [0-9.]+ s \(([^)]*) s since vLLM was started\)", text)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steady = [r for r in rows if r["step"] >= 3] or rows[-1:]
    return GrpoRun(variant.name, float(ready.group(1)) if ready else float("nan"),
                   (ready.group(2) or "") if ready else "", first, total,
                   statistics.median(r["rollout_time_s"] for r in steady),
                   statistics.median(r["step_time_s"] for r in steady), float(rows[0].get("mismatch_kl", "nan")),
                   os.getloadavg()[0], told.group(1) if told else "",
                   statistics.median(r["step_time_s"] for r in rows[-5:]), str(out))


def start_pool(port: int, args: list[str], env: dict[str, str], out: Path) -> harness.Child:
    """`tidal serve` for the run's port, once its state file says it serves (variant `pool`)."""
    child = harness.start("pool", [sys.executable, "-m", "tidal.cli", "serve", "--infer.port", str(port), *args],
                          out / "pool.log", env=env)
    state, deadline = Path(env["TIDAL_CACHE"]) / "pool" / "state.json", time.monotonic() + 900
    while not state.exists():
        if child.poll() is not None or time.monotonic() > deadline:
            harness.stop(child)
            raise RuntimeError(f"the warm pool did not start; see {out / 'pool.log'}")
        time.sleep(0.2)
    return child


def stop_pool(pool: harness.Child, env: dict[str, str]) -> None:
    """Stop the warm pool `start_pool` started (`tidal serve --stop`, then its process group)."""
    subprocess.run([sys.executable, "-m", "tidal.cli", "serve", "--stop"], env=env, timeout=120, check=False)
    harness.stop(pool)


def fmt_grpo(r: GrpoRun) -> str:
    return (f"| {r.variant} | **{r.ready_s:.1f}** | {r.phases} | {r.milestones or '-'} | **{r.first_step_s:.1f}** | "
            f"{r.total_s:.1f} | {r.rollout_s:.2f} | {r.step_s:.2f} | {r.last_step_s:.2f} | {r.mismatch_kl:.1e} | "
            f"{r.load:.2f} |")


def grpo_table(runs: list[GrpoRun], steps: int, what: str = "bundled example") -> str:
    lines = [f"`tidal grpo`, {what}, {steps} steps:", "",
             "| variant | vLLM ready s | phases s | milestones (s since vLLM started) | first step done s | "
             "whole run s | rollout s/step (steps >= 3) | step s (steps >= 3) | step s (last 5) | step-1 mismatch_kl | "
             "load 1-min |",
             "|---|---|---|---|---|---|---|---|---|---|---|",
             *(fmt_grpo(r) for r in runs), "", "Medians:", ""]
    for name in dict.fromkeys(r.variant for r in runs):
        mine = [r for r in runs if r.variant == name]

        def med(key: str, mine: list[GrpoRun] = mine) -> float:
            return statistics.median(getattr(r, key) for r in mine)

        lines.append(f"- {name}: vLLM ready {med('ready_s'):.1f} s, first step {med('first_step_s'):.1f} s, whole run "
                     f"{med('total_s'):.1f} s, rollout {med('rollout_s'):.2f} s/step, step {med('step_s'):.2f} s, "
                     f"last 5 {med('last_step_s'):.2f} s/step "
                     f"({len(mine)} runs)")
    return "\n".join(lines)


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="default", help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/tidal-vllm-startup"))
    ap.add_argument("--grpo-steps", type=int, default=0,
                    help="also run each variant as `tidal grpo` for this many steps (time to the first step)")
    ap.add_argument("--grpo-only", action="store_true", help="with --grpo-steps: skip the `tidal grpo-infer` starts")
    ap.add_argument("--configs", type=Path, help="a directory with train.yaml, infer.yaml and orch.yaml: its "
                    "infer.yaml for the `tidal grpo-infer` starts (and their bursts' model), all three for the `tidal "
                    "grpo` runs (e.g. examples/real_model; default: the bundled example)")
    ap.add_argument("--grpo-args", default="", help="with --grpo-steps: more `tidal grpo` arguments for every "
                    "variant, one shell-quoted string (e.g. \"--train.export.gguf null\" for bench/learn.py's runs)")
    ap.add_argument("--write", action="store_true", help="write the table into bench/STARTUP.md")
    args = ap.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    variants = [VARIANTS[v] for v in args.variants.split(",")]
    runs: list[Run] = []
    grpo: list[GrpoRun] = []
    configs = ([arg for c in ("train", "infer", "orch") for arg in (f"--{c}", str(args.configs / f"{c}.yaml"))]
               if args.configs else None)
    for _ in range(args.rounds):
        for v in [] if args.grpo_only and args.grpo_steps else variants:
            runs.append(time_start(v, args.requests, args.tokens, args.log_dir,
                                   args.configs / "infer.yaml" if args.configs else EXAMPLE))
            print(fmt_run(runs[-1]), flush=True)
        for v in variants if args.grpo_steps else []:
            grpo.append(time_grpo(v, args.grpo_steps, args.log_dir, configs, shlex.split(args.grpo_args)))
            print(fmt_grpo(grpo[-1]), f"({grpo[-1].out})", flush=True)
    what = str(args.configs or "bundled example")
    report = "\n\n".join(([table(runs)] if runs else []) + ([grpo_table(grpo, args.grpo_steps, what)] if grpo else []))
    print(report)
    if args.write:
        when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        cmd = "PYTHONPATH=src python bench/vllm_startup.py " + " ".join(sys.argv[1:])
        block = (f"<!-- generated -->\nMeasured {when} on {platform.node()} ({os.cpu_count()} cores, "
                 f"{cpu_model()}), `{cmd}`; {args.requests} requests x "
                 f"{args.tokens} tokens per burst.\n\n" + "\n".join(f"- {v.name}: {v.doc}" for v in variants)
                 + "\n\n" + report + "\n<!-- /generated -->")
        text = OUT.read_text() if OUT.exists() else ""
        text = re.sub(r"<!-- generated -->.*<!-- /generated -->", lambda _: block, text, flags=re.S) \
            if "<!-- generated -->" in text else text + "\n" + block + "\n"
        OUT.write_text(text)


if __name__ == "__main__":
    main()
