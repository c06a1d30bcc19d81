"""Bisect a growing vLLM engine core (issue 44 item 6): vLLM alone, with in-place reloads and/or sampling, no trainer.

Starts vLLM as `tidal grpo` starts it on CPU for the bundled model (`tidal.inference.backends.vllm.server`:
same argv and environment, weight reloads on, LoRA off, one core) plus `--worker-extension-cls
soak_probe.ProbeExtension`, whose methods run inside the engine-core process (on CPU the model worker lives there)
and are called over vLLM's dev route `/collective_rpc`: RSS, glibc's `mallinfo2` (heap in use / free), `malloc_trim`,
tracemalloc snapshots and Python object counts by type. Then the phases of `--phases` (`MODE:ITERS,...`, one vLLM
for all), each ITERS iterations of its MODE:
- `sample`: one step's rollouts (`--prompts` requests of n=`--n`, `--max-tokens` tokens, all in flight);
- `reload`: `/collective_rpc reload_weights` + `/reset_prefix_cache`, as the orchestrator's merged reload does
  (`tidal.inference.backends.vllm.client.reload_weights`), from a fresh copy of the weights at a new path each
  time (`broadcasts/step_n/merged`), or the same path with `--same-path`;
- `both`: a reload then a step's rollouts.
Every `--every` iterations it prints one line: iteration, engine RSS, heap in use / free (mallinfo2), Python
objects; with `--trim` it calls `malloc_trim(0)` then and prints the RSS after; with `--tracemalloc N` the engine
traces Python allocations during the last phase and its N largest growths are printed at the end. Each phase ends
with a line: the least-squares RSS slope per iteration from its second report on, the RSS before and after a
`malloc_trim(0)` (what is left is memory in use), and the phase's wall time per iteration (to compare knobs'
speed). `--env KEY=VALUE` sets vLLM's environment (allocator or oneDNN knobs). Figures and findings: bench/SOAK.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO / "scripts"))
import harness  # noqa: E402 - the benches' and checks' one harness (tidal.procs)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc() -> Any:
    return ctypes.CDLL("libc.so.6")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def heap() -> dict[str, float]:
    """glibc mallinfo2 in MiB: `used` (uordblks + hblkhd: allocated), `free` (fordblks: free in the arenas)."""
    libc = _libc()
    libc.mallinfo2.restype = _Mallinfo2
    m = libc.mallinfo2()
    return {"used": (m.uordblks + m.hblkhd) / 2**20, "free": m.fordblks / 2**20, "arena": m.arena / 2**20}


class ProbeExtension:
    """Mixed into vLLM's worker: runs in the engine-core process (CPU, uni executor)."""

    _tidal_snap: Any = None

    def tidal_probe_stats(self, trim: bool = False, types: int = 0) -> dict[str, Any]:
        out: dict[str, Any] = {"rss": rss_mib(), **heap(), "objects": len(gc.get_objects())}
        if types:
            from collections import Counter

            out["types"] = Counter(type(o).__name__ for o in gc.get_objects()).most_common(types)
        if trim:
            _libc().malloc_trim(0)
            out["rss_trimmed"] = rss_mib()
        return out

    def tidal_probe_tracemalloc(self, top: int = 0) -> list[str]:
        """First call: start tracing and take the reference snapshot; later calls: the `top` growths since."""
        import tracemalloc

        if not tracemalloc.is_tracing():
            tracemalloc.start(8)
            ProbeExtension._tidal_snap = tracemalloc.take_snapshot()
            return []
        snap = tracemalloc.take_snapshot()
        stats = snap.compare_to(ProbeExtension._tidal_snap, "traceback")[:top]
        return ["\n".join([str(s), *s.traceback.format()[-6:]]) for s in stats]


def post(url: str, payload: dict[str, Any], timeout: float = 600) -> Any:
    req = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        body = r.read()
    return json.loads(body) if body else None


def rpc(root: str, method: str, **kwargs: Any) -> Any:
    return post(f"{root}/collective_rpc", {"method": method, "kwargs": kwargs})["results"][0]


def rollouts(root: str, model: str, prompts: int, n: int, max_tokens: int, i: int) -> None:
    def one(k: int) -> None:
        post(f"{root}/v1/completions", {"model": model, "prompt": f"reverse: abcdefgh {i} {k}", "n": n,
                                        "max_tokens": max_tokens, "temperature": 1.0, "logprobs": 1})

    with concurrent.futures.ThreadPoolExecutor(prompts) as pool:
        list(pool.map(one, range(prompts)))


def run_phase(args: argparse.Namespace, root: str, model: str, src: Path, work: Path, mode: str, iters: int,
              first: int) -> list[tuple[float, float]]:
    """`iters` iterations of `mode` (numbered from `first`); the engine's RSS every `--every` of them."""
    points: list[tuple[float, float]] = []
    prev = None
    for i in range(first, first + iters + 1):
        if (i - first) % args.every == 0:
            s = rpc(root, "tidal_probe_stats", trim=args.trim, types=args.types)
            points.append((float(i), s["rss"]))
            print(f"{mode} iter {i:4d} rss {s['rss']:8.1f} MiB heap used {s['used']:7.1f} free {s['free']:7.1f} "
                  f"arena {s['arena']:7.1f} objects {s['objects']:8d}"
                  + (f" trimmed rss {s['rss_trimmed']:8.1f}" if "rss_trimmed" in s else ""), flush=True)
            if args.types:
                now = dict(s["types"])
                if prev is not None:
                    print("   types grown:", sorted(((now[k] - prev.get(k, 0), k) for k in now), reverse=True)[:5])
                prev = now
        if i == first + iters:
            break
        if mode in ("reload", "both"):
            path = src
            if not args.same_path:
                path = work / f"step_{i}"
                shutil.copytree(src, path)
                shutil.rmtree(work / f"step_{i - 2}", ignore_errors=True)
            rpc(root, "reload_weights", weights_path=str(path))
            post(f"{root}/reset_prefix_cache", {})
        if mode in ("sample", "both"):
            rollouts(root, model, args.prompts, args.n, args.max_tokens, i)
    return points


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", default="both", help="comma list of MODE[:ITERS], MODE one of sample, reload, both")
    ap.add_argument("--iters", type=int, default=200, help="iterations of a phase that names none")
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--same-path", action="store_true", help="reload from one path (default: a new copy each time)")
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) in the engine at every report")
    ap.add_argument("--tracemalloc", type=int, default=0,
                    help="trace Python allocations in the last phase; print its top N growths")
    ap.add_argument("--types", type=int, default=0, help="print the N most common Python object types per report")
    ap.add_argument("--prefix-caching", choices=("default", "on", "off"), default="default")
    ap.add_argument("--port", type=int, default=8770)
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment of vLLM")
    args = ap.parse_args()

    from soak import slope

    from tidal.config import InferConfig
    from tidal.inference.backends.vllm.server import vllm_argv, vllm_env
    from tidal.models.sources import resolve_model

    cfg = InferConfig(model="tidal:tiny-reverse", port=args.port, max_model_len=512, enable_lora=False,
                      weight_reload=True, log_stats=False,
                      enable_prefix_caching={"default": None, "on": True, "off": False}[args.prefix_caching])
    argv = [*vllm_argv(cfg), "--worker-extension-cls", "soak_probe.ProbeExtension"]
    env = {**vllm_env(cfg), "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0"),
           **dict(kv.split("=", 1) for kv in args.env)}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), str(REPO / "src"),
                                         *filter(None, [env.get("PYTHONPATH")])])
    work = Path(tempfile.mkdtemp(prefix="tidal-soak-probe-"))
    src = Path(resolve_model(cfg.model))
    root = f"http://127.0.0.1:{args.port}"
    print(f"probe: {vars(args)}; vLLM log {work / 'vllm.log'}", flush=True)
    proc = harness.start("vllm", argv, work / "vllm.log", env=env)
    try:
        harness.wait_ready(proc, f"{root}/health", 600)
        it = 0
        phases = args.phases.split(",")
        for n, phase in enumerate(phases):
            mode, _, count = phase.partition(":")
            if args.tracemalloc and n == len(phases) - 1:  # traced from the start of the last phase (warm-up done)
                rpc(root, "tidal_probe_tracemalloc")
            began = time.monotonic()
            points = run_phase(args, root, cfg.model, src, work, mode, int(count or args.iters), it)
            took = time.monotonic() - began  # the phase's wall time, its RSS reports included
            it += int(count or args.iters)
            s = rpc(root, "tidal_probe_stats", trim=True)
            print(f"phase {mode}: {slope(points[1:]):+.3f} MiB/iter over iters {points[1][0]:.0f}-{points[-1][0]:.0f} "
                  f"(rss {points[1][1]:.0f} -> {points[-1][1]:.0f} MiB); malloc_trim(0) then: {s['rss']:.0f} -> "
                  f"{s['rss_trimmed']:.0f} MiB; {took:.1f} s, {took / int(count or args.iters):.2f} s/iter", flush=True)
        if args.tracemalloc:
            for line in rpc(root, "tidal_probe_tracemalloc", top=args.tracemalloc):
                print(line, flush=True)
    finally:
        harness.stop(proc)
        for old in work.glob("step_*"):
            shutil.rmtree(old, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
