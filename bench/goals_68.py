"""Issue 68's goal rows in one invocation (item 5): writes bench/GOALS-68-ROWS.md and bench/goals_68_rows.json.

One invocation, every row one after the other on this machine (take its heavy lock: `flock /tmp/tidal-heavy.lock`):
- **bundled** (`make run`'s run: `tidal grpo` of the bundled example, 20 steps; bench/vllm_startup.py's `time_grpo`):
  `cold` (empty compile and model-inspection caches: a fresh machine, or a reboot, before `make setup`), `warm` (the
  caches `make setup` leaves: its last step, `make warm`, runs untimed before the first warm row) and `pool`
  (attached to a warm pool, `tidal serve`, started before it and not timed);
- **real** (SmolLM2-135M-Instruct on the bench-learn workload, bench/learn.py's `tidal_run`: examples/real_model,
  8 prompts x 8 completions, <= 64 tokens, 15 steps, tidal's own algorithm at lr 2e-4, one seed): `cold` (compile
  caches empty, the converted model kept: `make setup-real` converts it, the caches are what a reboot loses), `warm`
  (after `make warm-real`, setup-real's last step, untimed), `pool` (tidal's defaults: reference-answer guidance on,
  orch `guide_flat_groups: auto`, the addition task writing worked answers), and `unguided` (warm, `--orch.
  guide_flat_groups 0`: the defaults before guidance, bench/LEARN-68.md's `lr2e-4` arm); then one `tidal eval`
  (greedy, the task's 256 fixed problems) of their final adapters.
Per row: vLLM ready, first step done (since the command's start), whole run, s/step (median of the last 5 steps);
per real row also greedy accuracy and, against each recorded TRL run of bench/learn_68.json (the same workload, TRL
alone under the lock, 5 seeds; on the machine that file names), the time this row took to reach that TRL run's final
reward (mean of its last 5 steps) against 1/6 of that TRL run's whole time. The report's goal table is computed from
the rows; a goal not met says its gap.

    flock /tmp/tidal-heavy.lock .venv/bin/python bench/goals_68.py [--seed 0] [--rows bundled-cold,...] [--name NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import learn  # noqa: E402 - bench/learn.py: tidal_run, greedy_eval, final_reward, time_to_reach
import vllm_startup as vs  # noqa: E402 - bench/vllm_startup.py: time_grpo, start_pool, the variants' environments

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "GOALS-68-ROWS.md"
JSON = REPO / "bench" / "goals_68_rows.json"
TRL = REPO / "bench" / "learn_68.json"
UNGUIDED = "--orch.guide_flat_groups 0"
ROWS = ("bundled-cold", "bundled-warm", "bundled-pool", "real-cold", "real-warm", "real-pool", "real-unguided")
BASE = "base model (eval only)"
VARIANT = {"cold": "cold", "warm": "default", "pool": "pool", "unguided": "default"}
"""Each row kind's bench/vllm_startup.py variant (its environment: fresh caches, a warm pool)."""


def bundled_row(kind: str, steps: int, log_dir: Path) -> dict[str, Any]:
    """`tidal grpo` of the bundled example (what `make run` runs) as variant `kind`."""
    r = vs.time_grpo(vs.VARIANTS[VARIANT[kind]], steps, log_dir)
    return {"row": f"bundled-{kind}", "ready_s": r.ready_s, "phases": r.phases, "first_step_s": r.first_step_s,
            "total_s": r.total_s, "last5_step_s": r.last_step_s, "mismatch_kl_1": r.mismatch_kl, "load": r.load,
            "out": r.out}


def learn_args(seed: int, port: int, extra: str) -> argparse.Namespace:
    """bench/learn.py's arguments for tidal's run of the bench-learn workload (tidal's defaults: lr 2e-4, its own
    algorithm; `extra`: more `tidal grpo` arguments)."""
    return argparse.Namespace(steps=15, prompts=8, generations=8, max_tokens=64, lr=2e-4, lora_rank=16, lora_alpha=32,
                              port=port, tidal_algorithm="example", tidal_extra=extra, seeds=[seed])


def real_row(kind: str, seed: int, log_dir: Path) -> dict[str, Any]:
    """The bench-learn workload's tidal run as variant `kind` (a pool started first for `pool`, not timed)."""
    variant = vs.VARIANTS[VARIANT[kind]]
    work = Path(tempfile.mkdtemp(prefix=f"real-{kind}-", dir=log_dir))
    env = variant.environ(log_dir)
    port = vs.free_port()
    args = learn_args(seed, port, UNGUIDED if kind == "unguided" else "")
    pool = None
    if variant.pool:
        configs = [a for c in ("train", "infer", "orch") for a in (f"--{c}", str(learn.EXAMPLE / f"{c}.yaml"))]
        pool = vs.start_pool(port, configs, env, work)
    try:
        run = learn.tidal_run(args, work, seed, env={**env, "TIDAL_PLAIN": "1"})  # as learn.env_with sets it
    finally:
        if pool is not None:
            vs.stop_pool(pool, env)
    steps = [r["step_time_s"] for r in run["rows"]]
    return {"row": f"real-{kind}", "seed": seed, "extra": args.tidal_extra, "ready_s": run["ready_s"],
            "first_step_s": run["first_step_s"], "total_s": run["total_s"],
            "last5_step_s": statistics.median(steps[-5:]), "mismatch_kl_1": run["mismatch_kl_1"], "load": run["load"],
            "curve": run["curve"], "adapter": run["adapter"], "out": str(work)}


def trl_runs() -> list[dict[str, Any]]:
    """The recorded TRL runs of the same workload (bench/learn_68.json): curve, whole time, machine."""
    saved = json.loads(TRL.read_text())
    return [r for r in saved["runs"] if r["framework"] == "TRL"]


def trl_here(path: Path) -> list[dict[str, Any]]:
    """TRL runs of the same workload taken on this machine (a bench/learn.py `--modes trl` work directory's
    runs.json, e.g. `bench/learn.py --modes trl --seeds 0 --lr 5e-4 --no-eval --work DIR`): same-machine times."""
    saved = json.loads(path.read_text())
    runs = [r for r in saved["runs"] if r["framework"] == "TRL"]
    if not runs or saved["workload"] != trl_runs()[0]["workload"]:
        raise SystemExit(f"{path}: no TRL run of bench/learn_68.json's workload")
    return runs


def reach(row: dict[str, Any], trl: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per TRL run: its final reward, 1/6 of its whole time, and when `row` first reached that reward."""
    out = []
    for t in trl:
        target = learn.final_reward(t)
        out.append({"trl_seed": t["seed"], "target": target, "sixth_s": t["total_s"] / 6, "trl_total_s": t["total_s"],
                    "machine": t.get("machine", "?"), "reached_s": learn.time_to_reach(row, target)})
    return out


def in_time(hits: list[dict[str, Any]]) -> int:
    """How many of `reach`'s TRL runs the row reached within 1/6 of their time."""
    return sum(h["reached_s"] is not None and h["reached_s"] <= h["sixth_s"] for h in hits)


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"


def rows_table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| row | vLLM ready s | first step done s | whole run s | s/step (last 5) | step-1 mismatch_kl | "
           "greedy accuracy [95%] | TRL's final reward in 1/6 of its time | mean 1-min load |", "|---" * 9 + "|"]
    for r in rows:
        acc = r.get("accuracy")
        acc_s = f"{acc['accuracy']:.3f} [{acc['lo']:.3f}, {acc['hi']:.3f}]" if acc else "-"
        hits = r.get("reach")
        reach_s = (f"{in_time(hits)} of "
                   f"{len(hits)} TRL seeds (reached at {', '.join(fmt(h['reached_s'], 0) for h in hits)} s; 1/6: "
                   f"{', '.join(fmt(h['sixth_s'], 0) for h in hits)} s)") if hits else "-"
        kl = r["mismatch_kl_1"]
        out.append(f"| {r['row']} | {fmt(r['ready_s'])} | {fmt(r['first_step_s'])} | {fmt(r['total_s'])} | "
                   f"{fmt(r['last5_step_s'], 2)} | {'-' if kl != kl else f'{kl:.1e}'} | {acc_s} | {reach_s} | "
                   f"{fmt(r['load'], 2)} |")
    return out


def goals(rows: list[dict[str, Any]], trl_acc: list[float]) -> list[str]:
    """Issue 68's goals against this invocation's rows (a goal whose row did not run says so)."""
    by = {r["row"]: r for r in rows}

    def goal(name: str, row: str, key: str, limit: float) -> str:
        r = by.get(row)
        if r is None:
            return f"| {name} | {row} | not run | - |"
        v = r[key]
        return f"| {name} | {row} | {v:.1f} | {'yes' if v <= limit else f'no (+{v - limit:.1f})'} |"

    out = ["| goal | row | measured | met? (gap) |", "|---|---|---|---|",
           goal("`make run` whole <= 30 s after setup", "bundled-warm", "total_s", 30),
           goal("real model, first step <= 30 s after setup", "real-warm", "first_step_s", 30),
           goal("... with a warm pool <= 10 s", "real-pool", "first_step_s", 10),
           goal("<= 6 s per step at the end of a run (real model)", "real-warm", "last5_step_s", 6)]
    for name in ("real-warm", "real-unguided"):
        r = by.get(name)
        if r is None or "reach" not in r:
            continue
        hit = in_time(r["reach"])
        out.append(f"| TRL's final reward in <= 1/6 of TRL's time, every TRL seed (recorded TRL runs) | {name} | "
                   f"{hit} of {len(r['reach'])} | {'yes' if hit == len(r['reach']) else 'no'} |")
        out += [same_machine(name, r, h) for h in r.get("reach_here", [])]
        if "accuracy" in r and trl_acc:
            mean, sd = statistics.mean(trl_acc), statistics.stdev(trl_acc)
            a = r["accuracy"]["accuracy"]
            out.append(f"| greedy accuracy above TRL's (mean {mean:.3f} +- {sd:.3f} over {len(trl_acc)} seeds) | "
                       f"{name} | {a:.3f} (one seed) | {'above the mean' if a > mean else 'below the mean'}; "
                       f"{'outside' if a > mean + sd else 'inside'} TRL's spread (one seed says no more) |")
    return out


def same_machine(name: str, row: dict[str, Any], h: dict[str, Any]) -> str:
    """The 1/6 goal's line against a TRL run taken on this machine."""
    got = h["reached_s"]
    return (f"| ... against TRL seed {h['trl_seed']} on this machine (whole run {h['trl_total_s']:.0f} s, final reward "
            f"{h['target']:.3f}) | {name} | reached at {fmt(got, 0)} s, 1/6 = {h['sixth_s']:.0f} s; whole run "
            f"{h['trl_total_s'] / row['total_s']:.2f}x shorter | "
            f"{'yes' if got is not None and got <= h['sixth_s'] else 'no'} |")


PROBE = """
import json, time, torch
a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
a @ b
rates, loops = [], []
for _ in range(3):
    t = time.perf_counter()
    for _ in range(100):
        a @ b
    rates.append(2 * 1024 ** 3 * 100 / (time.perf_counter() - t) / 1e9)
    t = time.perf_counter()
    sum(range(20_000_000))
    loops.append(time.perf_counter() - t)
print(json.dumps({"matmul_gflop_s": max(rates), "python_loop_s": min(loops)}))
"""
"""`speed_probe`'s workload: 3 rounds of 100 float32 1024^3 matmuls (torch's threads) and of a pure-Python loop (one
core); the best round of each."""


def speed_probe() -> dict[str, float]:
    """How fast this machine runs now, in a fresh interpreter: float32 matmul GFLOP/s and the seconds of a fixed
    pure-Python loop (the start's import phases are that kind of work). A host that slows its guests makes every
    row slower; taken before and after the rows, it tells an invocation on a slow machine from a slower tidal."""
    return vs.harness.run_json([sys.executable, "-c", PROBE], 300, what="the speed probe")  # type: ignore[no-any-return]


def setup_step(family: str, log_dir: Path) -> str:
    """The warm-up step `make setup` (bundled) / `make setup-real` (real) ends with (`make warm` / `warm-real`: one
    GRPO step saving vLLM's compiled model, infer aot_compile true), run untimed: a warm row measures the state
    setup leaves, not whatever caches earlier runs left. Returns what ran."""
    target = "warm" if family == "bundled" else "warm-real"
    code, text = vs.harness.run(["make", "--no-print-directory", target], log_dir / f"{target}.log", 1800,
                                name=target)
    if code != 0:
        raise SystemExit(f"goals_68: make {target} failed (exit {code}):\n{text[-2000:]}")
    return f"make {target}"


def outputs(name: str) -> tuple[Path, Path]:
    """The report and the JSON of an invocation called `name` (`--name`; "": the ones README.md cites)."""
    return (OUT.with_name(f"GOALS-68-ROWS-{name.upper()}.md") if name else OUT,
            JSON.with_name(f"goals_68_rows-{name}.json") if name else JSON)


def run_rows(names: list[str], seed: int, log_dir: Path, saved: dict[str, Any], path: Path = JSON
             ) -> list[dict[str, Any]]:
    """Each named row, in order, the first warm row of each family after its setup step (`setup_step`); every
    finished one saved at once (temp + rename) should a later one fail."""
    rows: list[dict[str, Any]] = []
    warmed: set[str] = set()
    for name in names:
        family, kind = name.split("-", 1)
        setup = None
        if kind in ("warm", "unguided") and family not in warmed:
            setup = setup_step(family, log_dir)
            warmed.add(family)
        started = time.strftime("%H:%M:%S")
        row = bundled_row(kind, 20, log_dir) if family == "bundled" else real_row(kind, seed, log_dir)
        row.update(started=started, machine=learn.machine_id(), setup=setup)
        rows.append(row)
        print(f"goals_68: {name}: first step {row['first_step_s']:.1f} s, whole {row['total_s']:.1f} s", flush=True)
        save({**saved, "rows": rows}, path)
    return rows


def save(data: dict[str, Any], path: Path = JSON) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def evaluate(rows: list[dict[str, Any]], log_dir: Path) -> None:
    """One `tidal eval` of the real rows' final adapters (and the base model, appended as a row of its own);
    accuracies into the rows."""
    real = [r for r in rows if "adapter" in r]
    got = learn.greedy_eval(log_dir, real, cross_check=0)
    for r in real:
        r["accuracy"] = {k: got[r["adapter"]][k] for k in ("accuracy", "lo", "hi")}
    nan = float("nan")
    rows.append({"row": BASE, "accuracy": {k: got["base"][k] for k in ("accuracy", "lo", "hi")}, "ready_s": nan,
                 "first_step_s": nan, "total_s": nan, "last5_step_s": nan, "mismatch_kl_1": nan, "load": nan})


def report(data: dict[str, Any]) -> str:
    rows, trl = data["rows"], data["trl"]
    trl_machines = sorted({t.get("machine", "?") for t in trl})
    lines = [
        "# Issue 68's goal rows, one invocation (item 5)", "",
        f"`{data['command']}`, started {data['date']}, on {data['machine']}. Generated by bench/goals_68.py (its "
        "module doc says what each row runs); every row ran one after the other in this invocation, nothing else "
        "running beside it (the machine's heavy lock). The TRL runs the time and accuracy goals compare with are the "
        f"recorded ones of bench/learn_68.json (5 seeds, the same workload, alone under the lock, on "
        f"{'; '.join(trl_machines)}): a TRL time taken on a faster machine makes the 1/6 goal harder here.", "",
        *([data["note"], ""] if data.get("note") else []),
        "## Goals", "", *goals(rows, data["trl_accuracy"]), "",
        "## Rows", "", *rows_table(rows), "",
        "Phases of vLLM's start (bundled rows): " + "; ".join(f"{r['row']}: {r['phases']}" for r in rows
                                                              if r.get("phases")) + ".", ""]
    warmed = [f"{r['row']} after `{r['setup']}`" for r in rows if r.get("setup")]
    if warmed:
        lines += ["Setup before the warm rows (untimed): " + "; ".join(warmed) + ".", ""]
    speed = [f"{when} {data[k]['matmul_gflop_s']:.0f} GFLOP/s, loop {data[k]['python_loop_s']:.2f} s"
             for when, k in (("before the rows", "speed_before"), ("after", "speed_after")) if k in data]
    if speed:
        lines += ["Machine speed (`speed_probe`: float32 matmul rate, a fixed pure-Python loop): " + "; ".join(speed)
                  + ". Compare invocations only where these agree.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0, help="the real rows' seed")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/tidal-goals-68"))
    ap.add_argument("--trl-here", type=Path, help="a bench/learn.py `--modes trl` runs.json of the same workload "
                    "taken on this machine: the 1/6 goal also against it (same-machine times)")
    ap.add_argument("--finish", action="store_true", help="no runs: finish bench/goals_68_rows.json's saved rows "
                    "(reach, the evaluation where missing) and write the report")
    ap.add_argument("--name", default="", help="write bench/GOALS-68-ROWS-NAME.md and bench/goals_68_rows-NAME.json "
                    "(default: the report and rows README.md cites)")
    args = ap.parse_args()
    out, path = outputs(args.name)
    names = args.rows.split(",")
    if unknown := [n for n in names if n not in ROWS]:
        ap.error(f"--rows: unknown {', '.join(unknown)}")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    if args.finish:
        data = json.loads(path.read_text())
    else:
        trl = trl_runs()
        evals = json.loads(TRL.read_text())["evals"]
        data = {"command": "python bench/goals_68.py " + " ".join(sys.argv[1:]),
                "date": time.strftime("%Y-%m-%d %H:%M UTC"),
                "machine": f"{platform.node()} ({os.cpu_count()} cores, {vs.cpu_model()})",
                "trl": [{"seed": t["seed"], "total_s": t["total_s"], "machine": t.get("machine", "?"),
                         "final_reward": learn.final_reward(t)} for t in trl],
                "trl_accuracy": [evals[t["adapter"]]["accuracy"] for t in trl if t["adapter"] in evals]}
        data["speed_before"] = speed_probe()
        data["rows"] = run_rows(names, args.seed, args.log_dir, data, path)
        data["speed_after"] = speed_probe()
    if args.trl_here:
        data["trl_here"] = str(args.trl_here)
    finish(data, args.log_dir, out, path)
    print(f"goals_68: wrote {out} and {path}", flush=True)


def finish(data: dict[str, Any], log_dir: Path, out: Path = OUT, path: Path = JSON) -> None:
    """Each real row's reach of the TRL runs' final rewards, its greedy accuracy (one `tidal eval` for the rows that
    lack one), then the JSON and the report."""
    trl = trl_runs()
    rows = [r for r in data["rows"] if r["row"] != BASE]
    here = trl_here(Path(data["trl_here"])) if data.get("trl_here") else []
    for r in rows:
        if "curve" in r:
            r["reach"], r["reach_here"] = reach(r, trl), reach(r, here)
    if any("adapter" in r and "accuracy" not in r for r in rows):
        evaluate(rows, log_dir)
    else:
        rows += [r for r in data["rows"] if r["row"] == BASE]
    data["rows"] = rows
    save(data, path)
    out.write_text(report(data))


if __name__ == "__main__":
    main()
