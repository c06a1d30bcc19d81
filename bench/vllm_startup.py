"""vLLM start-up time of `tidal grpo-infer` on the bundled model, with a phase breakdown and a throughput check.

Each variant starts the server as a user does, `python -m tidal.cli grpo-infer <example infer.yaml>`
plus the variant's overrides (so tidal's own start-up is included), stamps every log line with the time since the start,
polls `/health` every 50 ms, then sends a generation burst (`--requests` completions of `--tokens` tokens each,
all in flight, EOS ignored) twice and reports tokens/s of both bursts (the first one may include lazy
warm-up). Variants run in rounds, alternating (A B C A B C ...), because the machine is shared and noisy; the
load average is recorded with every run.

Phases (from the log lines of tidal and vLLM 0.32's processes):
  tidal          start -> `tidal grpo-infer` execs vLLM (config parsing, checks; the "before" code prints no such
                 line, so there api_import includes it)
  api_import     -> the API server prints its arguments (python + vllm imports, argument parsing)
  engine_start   -> "Initializing a V1 LLM engine" (the engine-core process spawned and imported vllm)
  worker_start   -> "Starting to load model" (the worker process spawned, imported vllm, set up gloo)
  model_load     -> "Loading weights took" (model built, safetensors read)
  engine_init    -> "init engine (...) took" (LoRA wrappers, KV-cache allocation, compile / warm-up)
  api_up         -> "Application startup complete" (the API server builds its routes and tokenizer state)
  ready          -> first `/health` 200

Run: `PYTHONPATH=src python bench/vllm_startup.py [--rounds 2] [--variants default,inproc] [--write]`;
`--write` replaces bench/STARTUP.md's generated table with this run's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


EXAMPLE = REPO / "src/tidal/examples/reverse_text/infer.yaml"
OUT = REPO / "bench/STARTUP.md"

PHASES: list[tuple[str, str]] = [  # (phase name, regex of the log line that ends it)
    ("tidal", r"tidal grpo-infer: starting vLLM"),
    ("api_import", r"non-default args:"),
    ("engine_start", r"Initializing a V1 LLM engine"),
    ("worker_start", r"Starting to load model"),
    ("model_load", r"Loading weights took"),
    ("engine_init", r"init engine \(profile, create kv cache, warmup model\) took"),
    ("api_up", r"Application startup complete"),
]


@dataclass
class Variant:
    """A server configuration to time: `tidal grpo-infer` arguments and environment variables on top of the
    example's, and the tidal source tree that runs it."""

    name: str
    doc: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    src: str = str(REPO / "src")


VARIANTS: dict[str, Variant] = {v.name: v for v in [
    Variant("default", "`tidal grpo-infer` on the example infer.yaml (LoRA on), this checkout"),
    Variant("before", "the same, tidal's source from TIDAL_BEFORE_SRC (default /work/main/src: the code before "
            "this change, which imported torch and vllm before exec'ing the server)",
            src=os.environ.get("TIDAL_BEFORE_SRC", "/work/main/src")),
    Variant("inproc", "worker inside the engine-core process (uni executor): 2 processes instead of 3",
            args=["--infer.extra_args", '["--distributed-executor-backend", "uni"]'],
            env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
    Variant("nolora", "LoRA off (vLLM then torch.compiles the model with inductor; tidal sets VLLM_USE_AOT_COMPILE=0 "
            "on CPU, so torch's compile caches serve later starts)", args=["--infer.enable_lora", "false"]),
    Variant("nolora-aot", "LoRA off, VLLM_USE_AOT_COMPILE=1 (vLLM's default before this change: its AOT artifact "
            "fails to load on CPU, so every start compiles)", args=["--infer.enable_lora", "false"],
            env={"VLLM_USE_AOT_COMPILE": "1"}),
    Variant("nolora-eager", "LoRA off, enforce_eager (no torch.compile)",
            args=["--infer.enable_lora", "false", "--infer.enforce_eager", "true"]),
]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


async def burst(base: str, n: int, tokens: int) -> float:
    """Tokens/s of `n` concurrent completions of exactly `tokens` tokens (sampling at temperature 1, logprobs 1,
    as tidal's rollouts ask)."""
    body = {"model": "tidal:tiny-reverse", "prompt": [1, 5, 9, 17, 33, 41, 3], "max_tokens": tokens,
            "temperature": 1.0, "logprobs": 1, "ignore_eos": True, "min_tokens": tokens}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=n)) as client:
        async def one(i: int) -> int:
            r = await client.post(f"{base}/v1/completions", json={**body, "seed": i})
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        start = time.monotonic()
        done = await asyncio.gather(*(one(i) for i in range(n)))
        return sum(done) / (time.monotonic() - start)


def time_start(variant: Variant, requests: int, tokens: int, log_dir: Path) -> Run:
    port = free_port()
    argv = [sys.executable, "-m", "tidal.cli", "grpo-infer", str(EXAMPLE), "--infer.port", str(port),
            *variant.args]
    env = {**os.environ, "PYTHONPATH": variant.src, "PYTHONUNBUFFERED": "1", **variant.env}
    log_path = log_dir / f"{variant.name}-{port}.log"
    marks: dict[str, float] = {}
    start = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=REPO)

    def pump() -> None:
        assert proc.stdout is not None
        with open(log_path, "w") as log:
            for line in proc.stdout:
                t = time.monotonic() - start
                log.write(f"[{t:7.2f}] {line}")
                for name, pattern in PHASES:
                    if name not in marks and re.search(pattern, line):
                        marks[name] = t

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{variant.name}: server exited {proc.returncode}; see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.05)
        ready = time.monotonic() - start
        load = os.getloadavg()
        processes = count_family(proc.pid)
        rates = [asyncio.run(burst(base, requests, tokens)) for _ in range(4)]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=5)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="default", help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/tidal-vllm-startup"))
    ap.add_argument("--write", action="store_true", help="write the table into bench/STARTUP.md")
    args = ap.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    variants = [VARIANTS[v] for v in args.variants.split(",")]
    runs: list[Run] = []
    for _ in range(args.rounds):
        for v in variants:
            runs.append(time_start(v, args.requests, args.tokens, args.log_dir))
            print(fmt_run(runs[-1]), flush=True)
    report = table(runs)
    print(report)
    if args.write:
        when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        cmd = "PYTHONPATH=src python bench/vllm_startup.py " + " ".join(sys.argv[1:])
        block = (f"<!-- generated -->\nMeasured {when} on {platform.node()} ({os.cpu_count()} cores, "
                 f"{platform.processor() or platform.machine()}), `{cmd}`; {args.requests} requests x "
                 f"{args.tokens} tokens per burst.\n\n" + "\n".join(f"- {v.name}: {v.doc}" for v in variants)
                 + "\n\n" + report + "\n<!-- /generated -->")
        text = OUT.read_text() if OUT.exists() else ""
        text = re.sub(r"<!-- generated -->.*<!-- /generated -->", lambda _: block, text, flags=re.S) \
            if "<!-- generated -->" in text else text + "\n" + block + "\n"
        OUT.write_text(text)


if __name__ == "__main__":
    main()
