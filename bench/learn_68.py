"""Issue 68 item 4, more learned per sample: tidal's arms (learning rate, dynamic sampling, `num_iterations`) and TRL
on the bench-learn workload, evaluated together; writes bench/LEARN-68.md, bench/learn-68.png and bench/learn_68.json.

The runs themselves are bench/learn.py's, one invocation per seed (so each can take the machine's heavy lock alone):
tidal with its OWN algorithm (`--tidal-algorithm example`: examples/real_model passes no loss or advantage key, so
seed 000's defaults), each arm in its own `--work` directory, `--no-eval`; TRL (`--modes trl`) in another, each
seed alone under the machine's heavy lock too (its wall times are timings: TRL's own curve sets the targets of the
time goal). This script then
- `--eval`: runs one `tidal eval` (greedy, the addition task's fixed 256 problems, one vLLM, merged reloads) over the
  base model and every final adapter of the arms not yet in bench/learn_68.json (take the heavy lock for it; one
  invocation may be split in several by `--max-adapters`), and records the accuracies there; `--eval-size N` takes
  the task's first N fixed problems instead (the first 256 are the default set: each adapter's accuracy on those is
  recorded too, a check against the 256-problem figures), kept in its own `--json` / `--out` (a JSON file holds one
  evaluation size: the greedy accuracy's eval noise, ~0.028 at 256 problems, is most of an arm's spread);
- always: copies each run's curve and per-step metrics into bench/learn_68.json (the work directories live in /tmp)
  and writes the report from that file alone: per-seed table, mean ± sample std (min-max) per arm, the reward at equal
  samples trained, at equal samples generated (dynamic sampling generates more than it trains on: dropped groups count)
  and at equal wall-clock time; and issue 68's two learning goals against TRL, seed by seed: the time each tidal run
  took to reach each TRL seed's final reward (the mean of its last 5 steps) against 1/6 of that TRL seed's time, and
  the greedy accuracy of each arm against TRL's (difference of the means, and whether the mean ± std intervals and
  the min-max ranges overlap).

    python bench/learn_68.py --arm lr2e-4=/tmp/ls-learn/lr2e-4 ... --trl /tmp/ls-learn/trl [--eval]

Simplifications: samples generated are counted from the orchestrator's per-step `buffer/*` metrics, exact with
`oversampling_factor` 1.0 and no environment failures (each round asks for exactly the missing groups, so every
accepted group is kept): generated groups = groups per batch - `buffer/filled_with_dropped` + `buffer/dropped_groups`,
plus `extend/completions` (orch `extend_flat_groups`' extra completions). With `extend_flat_groups` a run's reward
curve is `reward/sampled_mean` (the groups' first draws: the policy's reward; bench/learn.py), not the trained
completions' `reward/mean`, which the choice of both rewards raises.
A run's mean 1-min load is in its row: above ~3 on this 2-core machine it shared the CPU and its times are not
timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import learn  # noqa: E402 - bench/learn.py: greedy_eval, spread, final_reward, time_to_reach

REPO = Path(__file__).resolve().parents[1]
KEEP = ("step", "reward/mean", "step_time_s", "buffer/dropped_groups", "buffer/filled_with_dropped", "buffer/rounds",
        "mismatch_kl", "reward/sampled_mean", "extend/completions", "extend/groups", "extend/found_signal",
        "guide/groups", "guide/completions")
"""Per-step metrics kept from each tidal run."""


def slim(run: dict[str, Any], arm: str) -> dict[str, Any]:
    """One run of bench/learn.py's runs.json, reduced to what the report reads, tagged with its arm."""
    out = {k: v for k, v in run.items() if k not in ("rows", "phases")}
    out["arm"] = arm
    out["rows"] = [{k: r[k] for k in KEEP if k in r} for r in run.get("rows", [])]
    return out


def collect(arms: list[tuple[str, Path]], trl: Path | None, known: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every run of the arms' runs.json files (and TRL's), newest copy first; runs of `known` (the JSON file's) whose
    work directory is gone are kept."""
    runs: dict[tuple[str, int], dict[str, Any]] = {(r["arm"], int(r["seed"])): r for r in known}
    for arm, work in [*arms, *([("trl", trl)] if trl else [])]:
        path = work / "runs.json"
        if not path.is_file():
            print(f"learn_68: {path} missing: arm {arm} has no runs yet", flush=True)
            continue
        saved = json.loads(path.read_text())
        for r in saved["runs"]:
            runs[(arm, int(r["seed"]))] = {**slim(r, arm), "workload": saved["workload"]}
    return sorted(runs.values(), key=lambda r: (r["arm"], int(r["seed"])))


def evaluate(runs: list[dict[str, Any]], evals: dict[str, Any], work: Path, most: int, size: int,
             seed: int | None = None) -> None:
    """`tidal eval` of at most `most` adapters not yet in `evals` (and the base model) on the first `size` fixed
    problems (of the set drawn with `seed`, when given), into `evals` (with `first256`, the accuracy on the first 256
    of the default set, when `size` is larger)."""
    todo = [r for r in runs if r["adapter"] not in evals and Path(r["adapter"]).is_dir()][:most]
    if not todo:
        print("learn_68: every adapter is evaluated", flush=True)
        return
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    got = learn.greedy_eval(work, todo, cross_check=0, eval_size=size, eval_seed=seed)
    record(evals, got, size, first256=seed is None)
    evals.setdefault("_meta", []).append({"adapters": len(todo), "seconds": got["seconds"], "ready_s": got["ready_s"],
                                         "wall_s": time.monotonic() - t0, "load": os.getloadavg()[0],
                                         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})


def record(evals: dict[str, Any], got: dict[str, Any], size: int, first256: bool = True) -> None:
    """`learn.greedy_eval`'s labels into `evals`: accuracy and its 95% interval, and with `size` above 256 (and
    `first256`: the default set's problems) the accuracy on the first 256 problems (the default set); a label scored
    on another number of problems is an error."""
    for key, value in got.items():
        if isinstance(value, dict) and "accuracy" in value:
            if len(value["rewards"]) != size:
                raise RuntimeError(f"tidal eval scored {len(value['rewards'])} problems for {key}, not {size}")
            evals[key] = {k: value[k] for k in ("accuracy", "lo", "hi")}
            if size > 256 and first256:
                evals[key]["first256"] = statistics.mean(value["rewards"][:256])


def generated(run: dict[str, Any]) -> list[int]:
    """Samples (completions) generated by each step, cumulative: trained ones plus dropped groups' (module doc)."""
    w = run["workload"]
    groups, out, total = w["prompts"], [], 0
    for r in run.get("rows") or [{}] * len(run["curve"]):
        g = groups - int(r.get("buffer/filled_with_dropped", 0)) + int(r.get("buffer/dropped_groups", 0))
        total += g * w["generations"] + int(r.get("extend/completions", 0))
        out.append(total)
    return out


def reward_at(run: dict[str, Any], x: float, axis: str) -> float:
    """Mean reward of the last 3 steps finished by `x` samples trained (`trained`), generated (`generated`) or wall
    seconds (`time`); nan when no step finished by then."""
    xs = {"time": [c[0] for c in run["curve"]], "trained": [c[1] for c in run["curve"]],
          "generated": generated(run)}[axis]
    done = [c[2] for c, v in zip(run["curve"], xs, strict=True) if v <= x + 1e-9]
    return statistics.mean(done[-3:]) if done else float("nan")


def machines(runs: list[dict[str, Any]]) -> str:
    """Which machine each arm's runs ran on (times compare only between runs of one machine)."""
    arms: dict[str, list[str]] = {}
    for r in runs:
        seen = arms.setdefault(r.get("machine", "?"), [])
        seen += [] if r["arm"] in seen else [r["arm"]]
    return "Runs ran on " + "; ".join(f"{m}: {', '.join(a)}" for m, a in arms.items()) + \
        " (times compare only between runs of one machine; accuracies do)."


def acc(evals: dict[str, Any], run: dict[str, Any]) -> float:
    return float(evals.get(run["adapter"], {}).get("accuracy", float("nan")))


def table(runs: list[dict[str, Any]], evals: dict[str, Any]) -> list[str]:
    """Per-seed rows."""
    out = ["| arm | seed | lr | extra | s/step | first step (s) | total (s) | samples generated | reward first 5 | "
           "reward last 5 | greedy accuracy [95%] | mean 1-min load |", "|---" * 12 + "|"]
    for r in runs:
        e = evals.get(r["adapter"], {})
        out.append(f"| {r['arm']} | {r['seed']} | {r['workload']['lr']} | {r.get('extra') or '-'} | "
                   f"{r['step_s']:.1f} | {r['first_step_s']:.1f} | {r['total_s']:.0f} | "
                   f"{generated(r)[-1]} | {statistics.mean(c[2] for c in r['curve'][:5]):.3f} | "
                   f"{learn.final_reward(r):.3f} | {e.get('accuracy', float('nan')):.3f} "
                   f"[{e.get('lo', float('nan')):.3f}, {e.get('hi', float('nan')):.3f}]"
                   + (f" (first 256: {e['first256']:.3f})" if "first256" in e else "") + f" | {r.get('load', 0):.1f} |")
    return out


def summary(runs: list[dict[str, Any]], evals: dict[str, Any]) -> list[str]:
    """Per arm: mean ± sample std (min-max) over seeds, and the reward at equal samples and equal time."""
    arms = sorted({r["arm"] for r in runs}, key=lambda a: (a == "trl", a))
    t_eq = min((r["curve"][-1][0] for r in runs), default=float("nan"))
    g_eq = min((generated(r)[-1] for r in runs), default=0)
    s_eq = min((r["curve"][-1][1] for r in runs), default=0)
    out = [f"Per arm, mean ± sample std (min-max) over seeds. Equal samples: the reward (mean of the last 3 steps) "
           f"after {s_eq} samples trained and after {g_eq} samples generated (dropped groups included); equal time: "
           f"after {t_eq:.0f} s from the command's start (the shortest run).",
           "",
           "| arm | seeds | greedy accuracy | reward last 5 | reward @ samples trained | reward @ samples generated | "
           "reward @ equal time | s/step | total (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        rs = [r for r in runs if r["arm"] == arm]
        out.append(f"| {arm} | {len(rs)} | {learn.spread([acc(evals, r) for r in rs], 3)} | "
                   f"{learn.spread([learn.final_reward(r) for r in rs], 3)} | "
                   f"{learn.spread([reward_at(r, s_eq, 'trained') for r in rs], 3)} | "
                   f"{learn.spread([reward_at(r, g_eq, 'generated') for r in rs], 3)} | "
                   f"{learn.spread([reward_at(r, t_eq, 'time') for r in rs], 3)} | "
                   f"{learn.spread([r['step_s'] for r in rs])} | {learn.spread([r['total_s'] for r in rs], 0)} |")
    return out


def time_goal(runs: list[dict[str, Any]]) -> list[str]:
    """Issue 68's goal "TRL's final reward in <= 1/6 of TRL's wall-clock time on every seed": per TRL seed, its final
    reward (mean of its last 5 steps) and 1/6 of its time; per tidal arm, how many of its runs reached that reward
    (3-step running mean, `learn.time_to_reach`) and when."""
    trls = [r for r in runs if r["framework"] == "TRL"]
    arms = sorted({r["arm"] for r in runs if r["framework"] != "TRL"})
    if not trls:
        return []
    out = ["TRL's final reward in <= 1/6 of TRL's time (issue 68): per TRL seed, its final reward (mean of its last 5 "
           "steps), its whole run and 1/6 of it; per tidal arm, the runs whose 3-step running mean reward reached "
           "that reward, with their times (s from the command's start; * within the 1/6).", "",
           "| TRL seed | final reward | TRL total s | 1/6 s | " + " | ".join(arms) + " |",
           "|---" * (4 + len(arms)) + "|"]
    for t in trls:
        target, limit = learn.final_reward(t), t["total_s"] / 6
        cells = []
        for arm in arms:
            got = [(r["seed"], learn.time_to_reach(r, target)) for r in runs if r["arm"] == arm]
            hits = [(s, x) for s, x in got if x is not None]
            inside = sum(x <= limit for _, x in hits)
            cells.append(f"{len(hits)}/{len(got)} reached, {inside} in time" + (
                " (" + ", ".join(f"s{s} {x:.0f}{'*' if x <= limit else ''}" for s, x in hits) + ")" if hits else ""))
        out.append(f"| {t['seed']} | {target:.3f} | {t['total_s']:.0f} | {limit:.0f} | " + " | ".join(cells) + " |")
    return out


def accuracy_goal(runs: list[dict[str, Any]], evals: dict[str, Any]) -> list[str]:
    """Issue 68's goal "at equal samples tidal's defaults learn more than TRL's (greedy accuracy, >= 5 seeds each,
    difference outside the spread)": each arm's greedy accuracy against TRL's."""
    trl = [acc(evals, r) for r in runs if r["framework"] == "TRL"]
    trl = [a for a in trl if a == a]
    if len(trl) < 2:
        return []
    tm, ts = statistics.mean(trl), statistics.stdev(trl)
    out = [f"Greedy accuracy against TRL's ({len(trl)} seeds: {learn.spread(trl, 3)}), issue 68's \"outside the "
           f"spread\": the arms' mean ± std intervals apart (above or below TRL's), and (stricter) their min-max "
           f"ranges apart; Welch's t of the two means.", "",
           "| arm | seeds | mean - TRL's mean | mean ± std apart | ranges apart | Welch t |", "|---" * 6 + "|"]
    for arm in sorted({r["arm"] for r in runs if r["framework"] != "TRL"}):
        accs = [a for a in (acc(evals, r) for r in runs if r["arm"] == arm) if a == a]
        if not accs:
            continue
        m, sd = statistics.mean(accs), statistics.stdev(accs) if len(accs) > 1 else 0.0
        apart = "above" if m - sd > tm + ts else "below" if m + sd < tm - ts else "no"
        ranges = "above" if min(accs) > max(trl) else "below" if max(accs) < min(trl) else "no"
        se = (sd ** 2 / len(accs) + ts ** 2 / len(trl)) ** 0.5
        out.append(f"| {arm} | {len(accs)} | {m - tm:+.3f} | {apart} | {ranges} | "
                   f"{(m - tm) / se if se else float('nan'):.1f} |")
    return out


def plot(runs: list[dict[str, Any]], out: Path) -> None:
    """Reward against samples generated and against wall-clock seconds, one line per run, one colour per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    arms = sorted({r["arm"] for r in runs})
    colors = {a: f"C{i}" for i, a in enumerate(arms)}
    seen: set[str] = set()
    for r in runs:
        label = None if r["arm"] in seen else r["arm"]
        seen.add(r["arm"])
        style = "--" if r["framework"] == "TRL" else "-"
        ys = [c[2] for c in r["curve"]]
        axes[0].plot(generated(r), ys, style, color=colors[r["arm"]], alpha=0.7, marker=".", label=label)
        axes[1].plot([c[0] for c in r["curve"]], ys, style, color=colors[r["arm"]], alpha=0.7, marker=".")
    axes[0].set_xlabel("samples generated (dropped groups and extensions included)")
    axes[1].set_xlabel("wall-clock s since the command started (TRL dashed)")
    for ax in axes:
        ax.set_ylabel("mean reward")
        ax.grid(alpha=0.3)
    axes[0].legend()
    steps = sorted({len(r["curve"]) for r in runs})
    fig.suptitle(f"SmolLM2-135M-Instruct, addition, 8x8x64, {'/'.join(map(str, steps))} steps: tidal arms and TRL "
                 "(one line per seed)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=WORK",
                    help="a tidal arm's bench/learn.py --work")
    ap.add_argument("--trl", default=None, help="TRL's bench/learn.py --work")
    ap.add_argument("--eval", action="store_true",
                    help="evaluate the adapters not yet evaluated (heavy: take the lock)")
    ap.add_argument("--max-adapters", type=int, default=14, help="at most this many adapters per --eval")
    ap.add_argument("--json", default=str(REPO / "bench" / "learn_68.json"))
    ap.add_argument("--out", default=str(REPO / "bench" / "LEARN-68.md"))
    ap.add_argument("--notes", default=None, help="a markdown file whose text goes after the tables (the reading)")
    ap.add_argument("--eval-size", type=int, default=256,
                    help="fixed problems per evaluation (a --json file holds one size)")
    ap.add_argument("--eval-seed", type=int, default=None, help="draw the fixed problems with this seed instead of "
                    "the task's own (1234): an independent set; a --json file holds one seed")
    args = ap.parse_args()
    path = Path(args.json)
    saved = json.loads(path.read_text()) if path.is_file() else {"runs": [], "evals": {}, "eval_size": args.eval_size,
                                                                  "eval_seed": args.eval_seed}
    if saved.get("eval_size", 256) != args.eval_size or saved.get("eval_seed") != args.eval_seed:
        sys.exit(f"learn_68: {path} holds evaluations on {saved.get('eval_size', 256)} problems drawn with seed "
                 f"{saved.get('eval_seed') or 'the default'}, not --eval-size {args.eval_size} --eval-seed "
                 f"{args.eval_seed or 'the default'}: give another --json")
    arms = [(a.split("=", 1)[0], Path(a.split("=", 1)[1])) for a in args.arm]
    runs = collect(arms, Path(args.trl) if args.trl else None, saved["runs"])
    evals = saved["evals"]
    if args.eval:
        evaluate(runs, evals, Path("/tmp/ls-learn/eval") / time.strftime("%H%M%S"), args.max_adapters, args.eval_size,
                 args.eval_seed)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"runs": runs, "evals": evals, "eval_size": args.eval_size, "eval_seed": args.eval_seed},
                              indent=1))
    tmp.replace(path)
    out = Path(args.out)
    png = out.with_name(out.stem.lower() + ".png")
    plot(runs, png)
    base = evals.get("base", {})
    meta = "; ".join(f"{m['adapters']} adapters in {m['seconds']:.0f} s after vLLM's {m['ready_s']:.0f} s (load "
                     f"{m['load']:.1f}, {m['date']})" for m in evals.get("_meta", []))
    lines = ["# Issue 68 item 4: more learned per sample (bench/learn_68.py)", "",
             f"Written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {learn.machine_id()}. {machines(runs)}",
             "",
             f"Greedy accuracy: `tidal eval`, the addition task's first {args.eval_size} fixed problems"
             f"{'' if args.eval_seed is None else f' drawn with seed {args.eval_seed} (not the default set)'}, "
             f"48 tokens; "
             f"base model "
             f"{base.get('accuracy', float('nan')):.3f} [{base.get('lo', float('nan')):.3f}, "
             f"{base.get('hi', float('nan')):.3f}]. Evaluations: {meta or 'none yet'}.", "",
             *table(runs, evals), "", *summary(runs, evals), "", *time_goal(runs), "",
             *accuracy_goal(runs, evals), "", f"![reward vs samples and time]({png.name})", ""]
    if args.notes:
        lines += [Path(args.notes).read_text(), ""]
    out.write_text("\n".join(lines))
    print(f"learn_68: wrote {out} ({len(runs)} runs, {sum(r['adapter'] in evals for r in runs)} adapters evaluated)")


if __name__ == "__main__":
    main()
