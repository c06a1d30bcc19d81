"""The CPU trainer's step under glibc's malloc and tcmalloc (`tidal.procs.malloc`, train / infer `malloc`):
writes bench/ALLOCATOR.md and bench/allocator.json.

An allocator is a process's from its start, so each measurement is a fresh process (`--child`): bench/trainer_step.py's
bench-learn batch (SmolLM2-135M-Instruct, LoRA r16 on all linear layers, float32, 64 completions of 8 addition
prompts) and the default trainer, `--steps` steps of `train_step`, each step's wall time, CPU user / system time and
minor page faults (`resource.getrusage`), and its loss and grad norm (the same update must come out under both:
an allocator moves no arithmetic). The parent runs `--rounds` rounds of one process per allocator, alternating,
with `malloc: system` (glibc's) and with `tcmalloc` (its library preloaded, as tidal's processes get it), and
reports per allocator the median of each step's time over the rounds and the ratio tcmalloc / glibc.

Run alone on the machine (the heavy lock): `flock /tmp/tidal-heavy.lock python bench/allocator.py`.

`--e2e LABEL=ALLOCATOR=DIR ...` adds whole runs to the report: `bench/learn.py --modes tidal --seeds S --no-eval --work
DIR` runs (tcmalloc for vLLM and the trainer, `auto`, or `--tidal-extra "--train.malloc system --infer.malloc
system"`), read from DIR/runs.json and DIR/tidal_seed*/metrics.jsonl: whole run, the medians of steps 3 onwards of
rollout, train and step time, and whether every run sampled the same rewards at every step (it should: an allocator
moves no arithmetic). They are copied into bench/allocator.json, which the report is written from.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "scripts"))
import harness  # noqa: E402 - the benches' one harness (tidal.procs)


def child(steps: int) -> dict[str, Any]:
    """One fresh process's steps (module doc); printed as one `ALLOCATOR {json}` line."""
    import trainer_step as ts

    from tidal.models.sources import resolve_model
    from tidal.procs import malloc
    from tidal.trainer.model.load import load_policy, load_tokenizer

    tok = load_tokenizer(str(resolve_model(ts.MODEL)))
    batch, pad = ts.build_batch(tok, 0), tok.pad_token_id or 0
    scorer, _ = load_policy(ts.train_config({}))
    batch.inference_logprobs[:] = ts.score(scorer.eval(), batch, pad)
    del scorer
    setup = ts.Setup("new", batch, pad)
    rows = []
    for _ in range(steps):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        setup.step()
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        rows.append({"wall_s": t1 - t0, "user_s": r1.ru_utime - r0.ru_utime, "sys_s": r1.ru_stime - r0.ru_stime,
                     "faults": r1.ru_minflt - r0.ru_minflt})
    lib = malloc.find_tcmalloc()
    return {"tcmalloc_loaded": bool(lib and malloc.loaded(lib)), "steps": rows, "first": setup.first,
            "load_1min": os.getloadavg()[0]}


def measure(kind: str, steps: int) -> dict[str, Any]:
    """A fresh `--child` process with glibc's malloc (`system`) or tcmalloc preloaded (`tcmalloc`)."""
    from tidal.procs import malloc

    lib = malloc.resolve(kind, "bench --kinds", True)  # type: ignore[arg-type]
    env = malloc.with_preload({k: v for k, v in harness.child_env().items() if k != "LD_PRELOAD"}, lib)
    log = Path("/tmp") / f"tidal-bench-allocator-{kind}.log"
    code, text = harness.run([sys.executable, __file__, "--child", "--steps", str(steps)], log, 1800, env=env,
                             name=f"allocator_{kind}")
    line = next((x for x in text.splitlines() if x.startswith("ALLOCATOR ")), None)
    if code != 0 or line is None:
        raise RuntimeError(f"{kind}: exit {code}: {text[-2000:]}")
    got = json.loads(line.split(" ", 1)[1])
    if got["tcmalloc_loaded"] != (kind == "tcmalloc"):
        raise RuntimeError(f"{kind}: tcmalloc loaded is {got['tcmalloc_loaded']} in the child")
    return {"kind": kind, **got}


def report(runs: list[dict[str, Any]], steps: int) -> list[str]:
    """The table: per allocator and step, the median over the rounds of wall / user / system time and faults."""
    kinds = ["system", "tcmalloc"]
    med = {(k, i, f): statistics.median(r["steps"][i][f] for r in runs if r["kind"] == k)
           for k in kinds for i in range(steps) for f in ("wall_s", "user_s", "sys_s", "faults")}
    lines = ["| allocator | step | wall s (median) | user s | system s | minor faults | wall / glibc's |",
             "|---|---|---|---|---|---|---|"]
    for k in kinds:
        for i in range(steps):
            ratio = med[(k, i, "wall_s")] / med[("system", i, "wall_s")]
            lines.append(f"| {'glibc (system)' if k == 'system' else k} | {i + 1} | {med[(k, i, 'wall_s')]:.2f} | "
                         f"{med[(k, i, 'user_s')]:.1f} | {med[(k, i, 'sys_s')]:.1f} | "
                         f"{med[(k, i, 'faults')] / 1e6:.3f} M | {ratio:.2f} |")
    walls = "; ".join(f"{r['kind']} " + ", ".join(f"{s['wall_s']:.1f}" for s in r["steps"]) for r in runs)
    same = len({json.dumps(r["first"], sort_keys=True) for r in runs}) == 1
    alike = "the same in every process" if same else "NOT the same in every process"
    return lines + ["", f"Every process's steps (s), in the order run: {walls}.", "",
                    f"The first step's loss, grad norm and token counts are {alike}: {json.dumps(runs[0]['first'])}."]


def e2e_run(label: str, kind: str, work: Path) -> dict[str, Any]:
    """One bench/learn.py run's figures (module doc)."""
    run = json.loads((work / "runs.json").read_text())["runs"][0]
    rows = [json.loads(x) for x in (work / f"tidal_seed{run['seed']}" / "metrics.jsonl").read_text().splitlines() if x]
    late = rows[2:] or rows
    return {"label": label, "kind": kind, "work": str(work), "total_s": run["total_s"], "date": run["date"],
            "load": run["load"], "steps": len(rows),
            **{f"{k}_s": statistics.median(r[f"{k}_time_s"] for r in late) for k in ("rollout", "train", "step")},
            "rewards": [r.get("reward/sampled_mean", r["reward/mean"]) for r in rows]}


def e2e_report(runs: list[dict[str, Any]]) -> list[str]:
    """The whole runs' table (module doc)."""
    same = len({json.dumps(r["rewards"]) for r in runs}) == 1
    lines = ["Whole runs (bench/learn.py, bench-learn workload; medians of steps 3 onwards):", "",
             "| run | allocator (vLLM and trainer) | whole run s | rollout s | train s | step s | mean load |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['label']} | {'glibc (system)' if r['kind'] == 'system' else r['kind']} | {r['total_s']:.0f} | "
              f"{r['rollout_s']:.2f} | {r['train_s']:.2f} | {r['step_s']:.2f} | {r['load']:.2f} |" for r in runs]
    return lines + ["", f"Rewards at every step: {'the same in every run' if same else 'NOT the same in every run'}."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="train steps per process (the first pays first touches)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(REPO / "bench" / "ALLOCATOR.md"))
    ap.add_argument("--e2e", nargs="*", default=[], metavar="LABEL=ALLOCATOR=DIR", help="whole runs (module doc)")
    ap.add_argument("--from-json", action="store_true", help="no new measurement: rewrite the report from "
                    "bench/allocator.json (plus any --e2e runs)")
    args = ap.parse_args()
    if args.child:
        print("ALLOCATOR " + json.dumps(child(args.steps)), flush=True)
        return
    from tidal.paths import write_atomic

    saved_path = Path(args.out).with_name("allocator.json")
    saved = json.loads(saved_path.read_text()) if args.from_json else {}
    runs = saved["runs"] if args.from_json else [measure(kind, args.steps) for _ in range(args.rounds)
                                                 for kind in ("system", "tcmalloc")]
    e2e = saved.get("e2e", [])
    for spec in args.e2e:
        label, kind, work = spec.split("=", 2)
        e2e.append(e2e_run(label, kind, Path(work)))
    if args.from_json:
        args.rounds, args.steps = saved["args"]["rounds"], saved["args"]["steps"]
    import platform

    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                if x.startswith("model name")), platform.processor())
    written = saved.get("written") or f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {cpu}"
    lines = ["# The CPU trainer's step: glibc's malloc against tcmalloc (`bench/allocator.py`)", "",
             f"Trainer steps measured {written}, {os.cpu_count()} cores, "
             f"{args.rounds} rounds of one fresh process per allocator, alternating (mean 1-min load "
             f"{statistics.mean(r['load_1min'] for r in runs):.2f}). Module doc of bench/allocator.py for the "
             f"workload.", "", *report(runs, args.steps)]
    if e2e:
        lines += ["", *e2e_report(e2e)]
    out = Path(args.out)
    write_atomic(out, "\n".join(lines) + "\n")
    write_atomic(saved_path, json.dumps({"args": {k: v for k, v in vars(args).items() if k != "e2e"}, "runs": runs,
                                         "written": written, "e2e": e2e}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
