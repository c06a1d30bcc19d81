"""The learning-bench figures README.md, docs/performance.md, docs/real-model.md and `tidal grpo`'s on-policy notice
quote are the ones scripts/bench_figures.py computes from the per-run rows of the bench file they cite (issue 66:
"8-9% longer" and "0-9% sooner" matched no committed rows, and the README's 4.7x / 3.55x was TRL's one seed on a slow
day beside bench/LEARN-SEEDS.md's 2.8x / 2.5x)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_figures", ROOT / "scripts" / "bench_figures.py")
assert spec is not None and spec.loader is not None
figures = importlib.util.module_from_spec(spec)
sys.modules["bench_figures"] = figures  # its dataclasses look their module up
spec.loader.exec_module(figures)


def flat(path: str) -> str:
    return " ".join((ROOT / path).read_text().split())


def test_the_script_recomputes_the_committed_rows():
    runs = figures.rows(ROOT / "bench" / "LEARN.md")
    assert {(r.mode, r.seed) for r in runs} >= {("tidal", 0), ("tidal-async1", 2), ("trl", 0)}
    (line,) = figures.mode_lines(runs, "tidal", "tidal-async1")
    assert line.endswith("tidal 9-16% longer, tidal-async1 8-14% sooner"), line
    assert figures.trl_lines(runs) == ["TRL / tidal seed 0: per step 4.72x, whole run 3.55x"]
    assert figures.trl_lines(figures.rows(ROOT / "bench" / "LEARN-SEEDS.md")) == [
        "TRL / tidal seed 1: per step 2.78x, whole run 2.54x", "TRL / tidal seed 2: per step 2.85x, whole run 2.57x"]
    assert figures.percent_range([0.091, 0.162]) == "9-16%" and figures.percent_range([0.1]) == "10%"
    with pytest.raises(ValueError, match="no per-run table"):
        figures.rows(ROOT / "README.md")


def test_the_quoted_figures_are_the_computed_ones():
    from tidal.colocate.derive import ON_POLICY_NOTICE

    learn = figures.rows(ROOT / "bench" / "LEARN.md")
    (line,) = figures.mode_lines(learn, "tidal", "tidal-async1")
    longer, sooner = line.split(": tidal ")[1].split(" longer")[0], line.split("tidal-async1 ")[-1].split(" sooner")[0]
    seeds = figures.by_seed(figures.rows(ROOT / "bench" / "LEARN-SEEDS.md"), "trl")
    trl = [ln.split(": ")[1] for ln in figures.trl_lines(figures.rows(ROOT / "bench" / "LEARN-SEEDS.md"))]
    assert len(seeds) == 2 and len(trl) == 2
    readme = flat("README.md")
    assert f"{longer} longer per seed than with the lag" in readme and "bench/LEARN.md" in readme
    assert "runs 2.54x and 2.57x shorter, steps 2.78x and 2.85x faster" in readme and "LEARN-SEEDS.md" in readme
    assert "gradient checkpointing on" in readme  # bench/learn.py's `trl` mode: --gradient-checkpointing on
    assert "8-9%" not in readme and "4.7x" not in readme
    perf = flat("docs/performance.md")
    assert f"runs {longer} longer per seed" in perf and f"The {sooner} sooner" in perf and "8-9%" not in perf
    notice = " ".join(ON_POLICY_NOTICE.split())
    assert f"ended its runs {sooner} sooner" in notice and "bench/LEARN.md" in notice
    assert "8-9%" not in flat("bench/LEARN.md").replace("the notes said 8-9%", "")


def test_a_cited_collapse_names_the_commit_that_holds_it():
    """bench/LEARN.md no longer holds the run without the IS correction that collapsed: docs citing it name the
    commit whose bench/LEARN.md does."""
    import subprocess

    assert "collapsed" not in (ROOT / "bench" / "LEARN.md").read_text()
    for doc in ("docs/real-model.md", "docs/trl.md", "README.md"):
        text = flat(doc)
        for hit in (i for i in range(len(text)) if text.startswith("collapsed", i)):
            assert "6a0478c:bench/LEARN.md" in text[hit - 300:hit + 300], doc
    old = subprocess.run(["git", "show", "6a0478c:bench/LEARN.md"], capture_output=True, text=True, cwd=ROOT)
    if old.returncode == 0:  # a checkout with the history
        assert "collapsed" in old.stdout


def test_the_quoted_learn_68_accuracies_are_the_recorded_ones():
    """README.md and docs/performance.md quote tidal's defaults and TRL's greedy accuracy over 5 seeds each from
    bench/learn_68.json (issue 68): the mean ± sample std recomputed from its evaluations."""
    import json
    import statistics

    saved = json.loads((ROOT / "bench" / "learn_68.json").read_text())

    def accuracy(arm: str) -> str:
        accs = [saved["evals"][r["adapter"]]["accuracy"] for r in saved["runs"] if r["arm"] == arm]
        assert len(accs) == 5, (arm, len(accs))
        return f"{statistics.mean(accs):.3f} ± {statistics.stdev(accs):.3f}"

    readme, perf = flat("README.md"), flat("docs/performance.md")
    for arm in ("lr2e-4", "trl", "guideq"):  # guideq: reference-answer guidance (orch guide_flat_groups)
        assert f"**{accuracy(arm)}**" in readme and f"**{accuracy(arm)}**" in perf, arm
    assert "bench/LEARN-68.md" in readme and "bench/LEARN-68.md" in perf



def test_the_quoted_loraplus_accuracies_are_the_recorded_ones():
    """docs/algorithms.md's LoRA+ section quotes five arms of bench/learn_68.json (LoRA+ at ratio 4 and 16, plain
    LoRA at 8e-4, 4e-4 and 2e-4, guidance on): each mean ± sample std recomputed from the arm's 5 evaluations, and the
    LoRA+ runs really set the key."""
    import json
    import statistics

    saved = json.loads((ROOT / "bench" / "learn_68.json").read_text())
    doc = flat("docs/algorithms.md")
    section = doc[doc.index("## LoRA+"):doc.index("## Advantages")]
    for arm in ("lp4", "g8e-4", "lp16", "guide4e-4", "guideq"):
        runs = [r for r in saved["runs"] if r["arm"] == arm]
        accs = [saved["evals"][r["adapter"]]["accuracy"] for r in runs]
        assert len(accs) == 5, (arm, len(accs))
        assert f"{statistics.mean(accs):.3f} ± {statistics.stdev(accs):.3f}" in section, arm
        if arm.startswith("lp"):
            assert all(f"--train.loraplus_lr_ratio {arm[2:]}" in json.dumps(r) for r in runs), arm

def test_the_quoted_guided_gemma_accuracy_is_the_recorded_one():
    """README.md and docs/performance.md quote the guided runs' greedy accuracy on the second task
    (bench/LEARN-GEMMA-GUIDE.json, 5 seeds each side): the mean ± sample std recomputed from its evaluations."""
    import json
    import statistics

    saved = json.loads((ROOT / "bench" / "LEARN-GEMMA-GUIDE.json").read_text())
    assert "--orch.guide_flat_groups 1" in saved["args"]["tidal_extra"]
    accs = [saved["evals"][r["adapter"]][0] for r in saved["runs"] if r.get("framework", "tidal") == "tidal"]
    assert len(accs) == 5
    quoted = f"**{statistics.mean(accs):.3f} ± {statistics.stdev(accs):.3f}**"
    readme, perf = flat("README.md"), flat("docs/performance.md")
    assert quoted in readme and quoted in perf
    assert "bench/LEARN-GEMMA-GUIDE.md" in readme and "bench/LEARN-GEMMA-GUIDE.md" in perf


def test_the_quoted_gemma_accuracies_are_the_recorded_ones():
    """README.md and docs/performance.md quote tidal's and TRL's greedy accuracy on the second task (Gemma 3 270M
    base, bench/LEARN-GEMMA-TRL.json, 5 seeds each): the mean ± sample std recomputed from its evaluations."""
    import json
    import statistics

    saved = json.loads((ROOT / "bench" / "LEARN-GEMMA-TRL.json").read_text())

    def accuracy(side: str) -> str:
        accs = [saved["evals"][r["adapter"]][0] for r in saved["runs"] if r.get("framework", "tidal") == side]
        assert len(accs) == 5, (side, len(accs))
        return f"{statistics.mean(accs):.3f} ± {statistics.stdev(accs):.3f}"

    readme, perf = flat("README.md"), flat("docs/performance.md")
    for side in ("tidal", "TRL"):
        assert f"**{accuracy(side)}**" in readme and f"**{accuracy(side)}**" in perf, side
    assert "bench/LEARN-GEMMA-TRL.md" in readme and "bench/LEARN-GEMMA-TRL.md" in perf


def test_the_quoted_make_run_times_are_one_invocations_rows():
    """README.md's `make run` times (warm, with a warm pool, on a cold cache) are the rows of the one invocation it
    cites (bench/goals_68_rows.json, issue 68 item 5), and the real model's rows carry the new default's greedy
    accuracy, which repeats bench/learn_68.json's `guideq` seed 0 (a seeded run of the same reference text)."""
    import json

    saved = json.loads((ROOT / "bench" / "goals_68_rows.json").read_text())
    rows = {r["row"]: r for r in saved["rows"]}
    readme = flat("README.md")
    warm, pool, cold = rows["bundled-warm"], rows["bundled-pool"], rows["bundled-cold"]
    assert f"takes {warm['total_s']:.1f} s once `.venv` exists (the first step at {warm['first_step_s']:.1f} s" \
        in readme
    assert f"{pool['total_s']:.1f} s, the first step at {pool['first_step_s']:.1f} s, with a warm pool" in readme
    assert f"{cold['total_s']:.1f} s on a cold compile cache" in readme
    assert "bench/GOALS-68-ROWS.md" in readme
    learn68 = json.loads((ROOT / "bench" / "learn_68.json").read_text())
    (guideq0,) = [r for r in learn68["runs"] if r["arm"] == "guideq" and r["seed"] == 0]
    assert rows["real-warm"]["accuracy"]["accuracy"] == learn68["evals"][guideq0["adapter"]]["accuracy"]
    assert f"({rows['real-warm']['accuracy']['accuracy']:.3f}; [bench/GOALS-68-ROWS.md]" in readme


def test_the_after_setup_invocation_ran_setup_before_its_warm_rows():
    """bench/GOALS-68-ROWS-SETUP.md's invocation measured "after setup": each warm row records the setup step that
    ran before it (`make warm`, `make warm-real`: vLLM's saved compiled model), the report says so, and its seeded
    real rows repeat the README invocation's greedy accuracies (the same runs, only the host's speed differed)."""
    import json

    saved = json.loads((ROOT / "bench" / "goals_68_rows-setup.json").read_text())
    rows = {r["row"]: r for r in saved["rows"]}
    assert rows["bundled-warm"]["setup"] == "make warm" and rows["real-warm"]["setup"] == "make warm-real"
    assert all(r.get("setup") is None for name, r in rows.items() if name not in ("bundled-warm", "real-warm"))
    report = (ROOT / "bench" / "GOALS-68-ROWS-SETUP.md").read_text()
    assert "bundled-warm after `make warm`; real-warm after `make warm-real`" in report
    readme_rows = {r["row"]: r for r in json.loads((ROOT / "bench" / "goals_68_rows.json").read_text())["rows"]}
    for name in ("real-warm", "real-unguided", "real-pool"):
        assert rows[name]["accuracy"] == readme_rows[name]["accuracy"], name


def test_the_gemma_defaults_reading_is_its_runs_against_trls():
    """bench/LEARN-GEMMA-DEFAULTS.md's reading (tidal at its own defaults on the second task against TRL's recorded
    runs) quotes the mean ± sample std of both sides recomputed from the two JSONs, and tidal's runs set nothing but
    the workload: the default learning rate, no extra `tidal grpo` flag (guidance is then the default's)."""
    import json
    import statistics

    ours = json.loads((ROOT / "bench" / "LEARN-GEMMA-DEFAULTS.json").read_text())
    trl = json.loads((ROOT / "bench" / "LEARN-GEMMA-TRL.json").read_text())
    from tidal.config.train import TrainConfig

    assert ours["args"]["lr"] == TrainConfig.model_fields["learning_rate"].default and not ours["args"]["tidal_extra"]

    def accuracy(saved: dict, side: str) -> str:
        accs = [saved["evals"][r["adapter"]][0] for r in saved["runs"] if r.get("framework", "tidal") == side]
        assert len(accs) == 5, (side, len(accs))
        return f"{statistics.mean(accs):.3f} ± {statistics.stdev(accs):.3f}"

    text = flat("bench/LEARN-GEMMA-DEFAULTS.md")
    assert f"**{accuracy(ours, 'tidal')} (0.586-0.719) against {accuracy(trl, 'TRL')} (0.453-0.602)**" in text


def test_the_quoted_1024_problem_accuracies_are_the_recorded_ones():
    """README.md and docs/performance.md quote tidal's defaults and TRL on 1024 problems from bench/learn_68_1024.json:
    the mean ± sample std recomputed from its evaluations, which really took 1024 problems, and the intervals apart."""
    import json
    import statistics

    saved = json.loads((ROOT / "bench" / "learn_68_1024.json").read_text())
    assert saved["eval_size"] == 1024
    readme, perf = flat("README.md"), flat("docs/performance.md")
    stats = {}
    for arm in ("default", "trl"):
        accs = [saved["evals"][r["adapter"]]["accuracy"] for r in saved["runs"] if r["arm"] == arm]
        assert len(accs) == 5, (arm, len(accs))
        stats[arm] = (statistics.mean(accs), statistics.stdev(accs))
        quoted = f"**{stats[arm][0]:.3f} ± {stats[arm][1]:.3f}**"
        assert quoted in readme and quoted in perf, arm
    assert stats["default"][0] - stats["default"][1] > stats["trl"][0] + stats["trl"][1], "the text says: apart"
    assert "bench/LEARN-68-1024.md" in readme and "bench/LEARN-68-1024.md" in perf


def test_the_quoted_exact_gemma_accuracies_are_the_recorded_ones():
    """README.md and docs/performance.md quote the second task's exact greedy accuracies: the same adapters as
    bench/LEARN-GEMMA-DEFAULTS-TRL.json (tidal's defaults, TRL at 2e-4) and bench/LEARN-GEMMA-TRL.json (TRL at
    1e-4), scored on every one of the task's problems once (`eval_all`); the mean ± sample std recomputed from the two
    JSONs, tidal's interval and range above both of TRL's, and the base model scored alike in both invocations."""
    import json
    import statistics

    every = json.loads((ROOT / "bench" / "LEARN-GEMMA-ALL.json").read_text())
    trl1 = json.loads((ROOT / "bench" / "LEARN-GEMMA-ALL-TRL1E-4.json").read_text())
    trained = {**{r["adapter"]: r for r in json.loads((ROOT / "bench" / "LEARN-GEMMA-DEFAULTS-TRL.json").read_text())[
        "runs"]}, **{r["adapter"]: r for r in json.loads((ROOT / "bench" / "LEARN-GEMMA-TRL.json").read_text())["runs"]
                     if r.get("framework") == "TRL"}}
    for saved in (every, trl1):
        args = saved["args"]
        assert args["eval_all"] and saved["evals"]["examples"] == (args["high"] - args["low"] + 1) ** 2 == 400
        assert all(trained[r["adapter"]]["rewards"] == r["rewards"] for r in saved["runs"])  # re-scored, not retrained
    assert every["evals"]["base"] == trl1["evals"]["base"]
    sides = {}
    for name, saved, side, lr in (("tidal", every, "tidal", 2e-4), ("trl2", every, "TRL", 2e-4),
                                  ("trl1", trl1, "TRL", 1e-4)):
        runs = [r for r in saved["runs"] if r.get("framework", "tidal") == side]
        assert len(runs) == 5 and all(r["recipe"]["lr"] == lr for r in runs), name
        sides[name] = [saved["evals"][r["adapter"]][0] for r in runs]
    readme, perf = flat("README.md"), flat("docs/performance.md")
    for name, accs in sides.items():
        quoted = f"**{statistics.mean(accs):.3f} ± {statistics.stdev(accs):.3f}** ({min(accs):.3f}-{max(accs):.3f})"
        assert quoted in readme and quoted in perf, name
    ours = sides["tidal"]
    for name in ("trl2", "trl1"):  # the text says: apart, ranges included
        assert statistics.mean(ours) - statistics.stdev(ours) > statistics.mean(sides[name]) + statistics.stdev(
            sides[name]) and min(ours) > max(sides[name]), name
    assert "bench/LEARN-GEMMA-ALL.md" in readme and "bench/LEARN-GEMMA-ALL.md" in perf


def test_the_quoted_allocator_ratios_are_the_recorded_ones():
    """README.md and docs/performance.md quote tcmalloc's trainer-step ratios against glibc's malloc from
    bench/allocator.json (medians over its alternating rounds of fresh processes), every process computing the same
    first step."""
    import json
    import statistics

    saved = json.loads((ROOT / "bench" / "allocator.json").read_text())
    runs = saved["runs"]
    assert saved["args"]["rounds"] >= 3 and len({json.dumps(r["first"], sort_keys=True) for r in runs}) == 1
    readme, perf = flat("README.md"), flat("docs/performance.md")
    for step, words in ((0, "first step"), (1, "later steps")):
        med = {k: statistics.median(r["steps"][step]["wall_s"] for r in runs if r["kind"] == k)
               for k in ("system", "tcmalloc")}
        quoted = f"**{med['tcmalloc'] / med['system']:.2f}x**"
        assert quoted in readme and quoted in perf, (words, quoted)
    assert "bench/ALLOCATOR.md" in readme and "bench/ALLOCATOR.md" in perf


def test_the_quoted_bf16_both_sides_figures_are_the_recorded_ones():
    """README.md and docs/performance.md quote bench/learn_68_s83.json (times, the 1/6 goal's seed pairs, 256-problem
    accuracies) and bench/learn_68_1024_s83.json (1024-problem accuracies): recomputed from the runs and evaluations,
    the pairs with bench/learn.py's own `final_reward` and `time_to_reach`."""
    import json
    import statistics

    spec = importlib.util.spec_from_file_location("bench_learn", ROOT / "bench" / "learn.py")
    assert spec is not None and spec.loader is not None
    learn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(learn)
    readme, perf = flat("README.md"), flat("docs/performance.md")

    def stats(xs: list[float], digits: int) -> str:
        return f"**{statistics.mean(xs):.{digits}f} ± {statistics.stdev(xs):.{digits}f}**"

    saved = json.loads((ROOT / "bench" / "learn_68_s83.json").read_text())
    runs = {arm: [r for r in saved["runs"] if r["arm"] == arm] for arm in ("tcm-default", "tcm-bf16b", "trl")}
    assert [len(v) for v in runs.values()] == [5, 5, 5] and saved["eval_size"] == 256
    for arm, key in (("tcm-default", "0.734"), ("tcm-bf16b", "0.726")):
        accs = [saved["evals"][r["adapter"]]["accuracy"] for r in runs[arm]]
        assert stats(accs, 3) == f"**{key} ± {'0.037' if arm == 'tcm-default' else '0.035'}**"
        assert stats(accs, 3) in perf
    for arm in ("tcm-default", "tcm-bf16b"):
        quoted = stats([r["total_s"] for r in runs[arm]], 0).removesuffix("**") + " s**"
        assert quoted in readme and quoted in perf, (arm, quoted)
    pairs = {arm: sum((x := learn.time_to_reach(r, learn.final_reward(t))) is not None and x <= t["total_s"] / 6
                      for r in runs[arm] for t in runs["trl"]) for arm in ("tcm-default", "tcm-bf16b")}
    assert pairs == {"tcm-default": 7, "tcm-bf16b": 24}
    assert "on 24 of 25 seed pairs (float32: 7)" in readme and "**24 of 25** seed pairs (float32: 7)" in perf
    big = json.loads((ROOT / "bench" / "learn_68_1024_s83.json").read_text())
    assert big["eval_size"] == 1024
    for arm in ("tcm-default", "tcm-bf16b"):
        accs = [big["evals"][r["adapter"]]["accuracy"] for r in big["runs"] if r["arm"] == arm]
        assert len(accs) == 5 and stats(accs, 3) in readme, arm


def test_the_quoted_bf16_default_figures_are_the_recorded_ones():
    """README.md quotes bench/learn_68_s84.json (arm s84-auto: tidal's defaults with bf16 resolved on the bench CPU;
    whole-run times, the 1/6 goal's seed pairs with bench/learn.py's own functions; s84-control's time against
    tcm-bf16b's for the same seed) and bench/learn_68_1024_s84.json (1024-problem accuracy)."""
    import json
    import statistics

    spec = importlib.util.spec_from_file_location("bench_learn", ROOT / "bench" / "learn.py")
    assert spec is not None and spec.loader is not None
    learn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(learn)
    readme = flat("README.md")
    saved = json.loads((ROOT / "bench" / "learn_68_s84.json").read_text())
    runs = {arm: [r for r in saved["runs"] if r["arm"] == arm]
            for arm in ("s84-auto", "trl", "s84-control", "tcm-bf16b")}
    assert [len(runs[a]) for a in ("s84-auto", "trl")] == [5, 5]
    totals = [r["total_s"] for r in runs["s84-auto"]]
    assert f"**{statistics.mean(totals):.0f} ± {statistics.stdev(totals):.0f} s**" in readme
    pairs = sum((x := learn.time_to_reach(r, learn.final_reward(t))) is not None and x <= t["total_s"] / 6
                for r in runs["s84-auto"] for t in runs["trl"])
    assert f"**{pairs} of 25** seed pairs" in readme and pairs == 23
    control = runs["s84-control"][0]
    before = next(r for r in runs["tcm-bf16b"] if r["seed"] == control["seed"])
    slower = round(100 * (control["total_s"] / before["total_s"] - 1))
    assert f"{slower}% slower ({control['total_s']:.0f} s against {before['total_s']:.0f} s)" in readme
    big = json.loads((ROOT / "bench" / "learn_68_1024_s84.json").read_text())
    accs = [big["evals"][r["adapter"]]["accuracy"] for r in big["runs"] if r["arm"] == "s84-auto"]
    assert big["eval_size"] == 1024 and len(accs) == 5
    assert f"**{statistics.mean(accs):.3f} ± {statistics.stdev(accs):.3f}**" in readme
