"""Long-tail rows of `make bench` (issue 44): gated vs in-flight on `reverse-text-longtail`, same machine, same run.

Imported by `bench/run_bench.py` (its `--workload` and `--longtail-quick` options; `quick_report` and `prepend` write
`--longtail-quick`'s table into bench/ROLLOUT-LONGTAIL.md). What it adds to a `tidal grpo` run of the bench:
- the workload: `reverse-text-longtail` (`tidal.envs.longtail`: text lengths log-normal, median 8 letters,
  sigma 1.25, up to `--longtail-max-len`), whose completions mostly stop after a few tokens while a few run to
  `max_tokens`;
- a sampler of vLLM's `/metrics` (`vllm:num_requests_running`, `vllm:num_requests_waiting`, every `PERIOD_S`)
  during the run, which needs vLLM's engine statistics (`--infer.log_stats true`: on for both modes, so both pay
  the same ~13% of rollout throughput, bench/ROLLOUT.md);
- per run, over the steady state (from the end of step 2 to the end of the last step): time per step, vLLM busy
  fraction (share of samples with >= 1 running sequence) and mean running sequences (how full vLLM's batch is),
  the trainer's idle fraction (its `wait_time_s` for a batch over its step time), staleness, groups dropped, and
  reward against samples trained.
"""

from __future__ import annotations

import re
import statistics
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

PERIOD_S = 0.2

LONGTAIL_ARGS = ("--orch.env", "[{id: reverse-text-longtail, args: {median: 8, sigma: 1.25, max_len: MAXLEN}}]")
"""`tidal grpo` arguments of the long-tail workload (`MAXLEN` replaced by `--longtail-max-len`)."""

PARTIAL_ARGS = ("--orch.partial_rollouts", "abort_resume")
"""`tidal grpo` arguments of the partial-rollouts run (`--longtail-partial`, issue 52)."""

_GAUGE = re.compile(r"^(vllm:num_requests_(?:running|waiting))\{[^}]*\}\s+([0-9.eE+-]+)$", re.M)


def parse_gauges(text: str) -> dict[str, float]:
    """`vllm:num_requests_running` / `_waiting` from a Prometheus text page (summed over engines); {} if absent."""
    out: dict[str, float] = {}
    for name, value in _GAUGE.findall(text):
        key = name.removeprefix("vllm:num_requests_")
        out[key] = out.get(key, 0.0) + float(value)
    return out


class Sampler:
    """A thread that reads vLLM's `/metrics` every `PERIOD_S` and notes how many steps the trainer had finished
    then (lines of `metrics.jsonl`), so the steady state can be cut out afterwards."""

    def __init__(self, port: int, metrics: Path) -> None:
        self.url, self.metrics = f"http://127.0.0.1:{port}/metrics", metrics
        self.samples: list[tuple[float, int, float, float]] = []  # (time, steps done, running, waiting)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _steps(self) -> int:
        try:
            return self.metrics.read_bytes().count(b"\n")
        except OSError:
            return 0

    def _run(self) -> None:
        while not self._stop.wait(PERIOD_S):
            try:
                with urllib.request.urlopen(self.url, timeout=2) as r:  # noqa: S310 - localhost
                    g = parse_gauges(r.read().decode())
            except OSError:
                continue  # not up yet, or gone
            if "running" in g:
                self.samples.append((time.monotonic(), self._steps(), g["running"], g.get("waiting", 0.0)))

    def busy(self, first: int, last: int) -> dict[str, float]:
        """vLLM over the samples taken while steps `first` < done <= `last` were running (the steady state)."""
        got = [s for s in self.samples if first <= s[1] < last]
        if not got:
            return {"busy": float("nan"), "running": float("nan"), "waiting": float("nan"), "samples": 0.0}
        return {"busy": sum(s[2] > 0 for s in got) / len(got), "running": statistics.mean(s[2] for s in got),
                "waiting": statistics.mean(s[3] for s in got), "samples": float(len(got))}


def summarize(run: dict[str, Any], sampler: Sampler, steps: int) -> dict[str, Any]:
    """The long-tail measures of one `tidal_run` (run_bench) result, over steps > 2 (steady state)."""
    rows = run["rows"]
    steady = [r for r in rows if r["step"] > 2] or rows[-1:]
    seen, per_sample = 0.0, []
    for r in rows:  # reward against samples trained (the batch's rollouts)
        seen += float(r.get("samples", 0.0))
        per_sample.append((seen, r["reward/mean"]))
    return {**run, **sampler.busy(2, steps),
            "idle": sum(r.get("wait_time_s", 0.0) for r in steady) / max(1e-9, sum(r["step_time_s"] for r in steady)),
            "per_sample": per_sample, "samples": seen,
            "len_mean": statistics.mean(r.get("completions/mean_length", float("nan")) for r in steady),
            "len_max": max(r.get("completions/max_length", 0.0) for r in rows),
            "clipped": statistics.mean(r.get("completions/clipped_ratio", 0.0) for r in steady),
            "reward_last3": statistics.mean(r["reward/mean"] for r in rows[-3:]),
            "token_stale": statistics.mean(r.get("staleness/token_mean", float("nan")) for r in rows),
            "decile_stale": statistics.mean(r.get("staleness/longest_decile", float("nan")) for r in rows),
            "decile_token_stale": statistics.mean(r.get("staleness/longest_decile_token_mean", float("nan"))
                                                  for r in rows),
            "stopped": sum(r.get("partial/stopped_requests", 0.0) for r in rows),
            "resumed": sum(r.get("partial/resumed_requests", 0.0) for r in rows)}


def rows(name: str, gated: dict[str, Any], inflight: dict[str, Any]) -> list[str]:
    """Markdown table rows: in-flight against gated on one workload, same bench run."""
    def busy(r: dict[str, Any]) -> str:
        return f"{r['busy']:.0%} busy, {r['running']:.1f} running (waiting {r['waiting']:.1f})"

    return [
        f"| {name}: time per step, in-flight vs gated | {inflight['step_s']:.2f} s | {gated['step_s']:.2f} s | "
        f"**{gated['step_s'] / inflight['step_s']:.2f}x** | >= 1.5x (long tail), >= 1x (uniform) |",
        f"| {name}: whole run (vLLM start-up included) | {inflight['total_s']:.0f} s | {gated['total_s']:.0f} s | "
        f"{gated['total_s'] / inflight['total_s']:.2f}x | |",
        f"| {name}: vLLM busy fraction, mean running (waiting) sequences (`/metrics`, steady state) | "
        f"{busy(inflight)} | {busy(gated)} | | |",
        f"| {name}: trainer idle fraction (waiting for a batch / step time) | {inflight['idle']:.0%} | "
        f"{gated['idle']:.0%} | | |",
        f"| {name}: rollout / train time per step (steady state) | {inflight['rollout_s']:.2f} / "
        f"{inflight['train_s']:.2f} s | {gated['rollout_s']:.2f} / {gated['train_s']:.2f} s | | |",
        f"| {name}: staleness mean / max; stale groups dropped; samples across a policy switch | "
        f"{inflight['staleness']:.2f} / {inflight['staleness_max']:.0f}; {inflight['dropped']:.0f}; "
        f"{inflight['switched']:.0f} | {gated['staleness']:.2f} / {gated['staleness_max']:.0f}; "
        f"{gated['dropped']:.0f}; {gated['switched']:.0f} | | |",
        f"| {name}: completion length mean (steady) / max, tokens; share cut at max_tokens | "
        f"{inflight['len_mean']:.1f} / {inflight['len_max']:.0f}; {inflight['clipped']:.1%} | "
        f"{gated['len_mean']:.1f} / {gated['len_max']:.0f}; {gated['clipped']:.1%} | | |",
        f"| {name}: reward, mean of the last 3 steps; after N samples trained | {inflight['reward_last3']:.3f}; "
        f"{curve_text(inflight)} | {gated['reward_last3']:.3f}; {curve_text(gated)} | | |",
    ]


def partial_rows(name: str, inflight: dict[str, Any], partial: dict[str, Any]) -> list[str]:
    """Markdown table rows: in-flight with partial rollouts (issue 52) against in-flight without, same bench run
    (the ratio column: in-flight's time per step over partial's)."""
    def stale(r: dict[str, Any]) -> str:
        return (f"{r['staleness']:.2f} / {r['staleness_max']:.0f}; {r['dropped']:.0f}; {r['switched']:.0f}; "
                f"{r.get('stopped', 0.0):.0f} / {r.get('resumed', 0.0):.0f}")

    def tokens(r: dict[str, Any]) -> str:
        return (f"{r.get('token_stale', float('nan')):.2f}; {r.get('decile_stale', float('nan')):.2f} / "
                f"{r.get('decile_token_stale', float('nan')):.2f}")

    return [
        f"| {name}: time per step, partial rollouts vs in-flight without | {partial['step_s']:.2f} s | "
        f"{inflight['step_s']:.2f} s | {inflight['step_s'] / partial['step_s']:.2f}x | >= 0.9x |",
        f"| {name}: staleness mean / max; stale groups dropped; samples across a switch; requests stopped / "
        f"continued (partial vs in-flight) | {stale(partial)} | {stale(inflight)} | | |",
        f"| {name}: staleness per token; longest decile of completions by oldest token / per token (partial vs "
        f"in-flight) | {tokens(partial)} | {tokens(inflight)} | | |",
        f"| {name}: rollout / train time per step (partial vs in-flight) | {partial['rollout_s']:.2f} / "
        f"{partial['train_s']:.2f} s | {inflight['rollout_s']:.2f} / {inflight['train_s']:.2f} s | | |",
        f"| {name}: reward, last 3 steps; after N samples trained (partial vs in-flight) | "
        f"{partial['reward_last3']:.3f}; {curve_text(partial)} | {inflight['reward_last3']:.3f}; "
        f"{curve_text(inflight)} | | |",
    ]


def measure_rows(lt: dict[str, dict[str, Any]]) -> list[str]:
    """`make bench`'s long-tail rows (measure 8): in-flight vs gated, then partial rollouts where `lt` has them."""
    return [*rows("long tail", lt["gated"], lt["in_flight"]),
            *(partial_rows("long tail", lt["in_flight"], lt["partial"]) if "partial" in lt else [])]


def quick_report(runs: dict[tuple[str, str], dict[str, Any]], workloads: tuple[str, ...],
                 header: list[str]) -> list[str]:
    """`--longtail-quick`'s lines: `header`, then per workload in-flight vs gated (`rows`), then partial rollouts vs
    in-flight (`partial_rows`) where `runs` holds a (workload, "partial") run."""
    def name(w: str) -> str:
        return "long tail" if w == "longtail" else w

    return [*header, "", "| measure | in-flight | gated | ratio | target |", "|---|---|---|---|---|",
            *[row for w in workloads for row in rows(name(w), runs[w, "gated"], runs[w, "in_flight"])],
            *[row for w in workloads if (w, "partial") in runs
              for row in partial_rows(name(w), runs[w, "in_flight"], runs[w, "partial"])]]


def prepend(out: Path, lines: list[str]) -> None:
    """`lines` at the top of the results in `out` (after its `<!-- results -->` marker; earlier results stay below;
    a new file gets the title and the marker)."""
    text = out.read_text() if out.exists() else "# Long-tail rollouts: gated vs in-flight\n\n<!-- results -->\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text.replace("<!-- results -->", "<!-- results -->\n" + "\n".join(lines) + "\n", 1))


def curve_text(r: dict[str, Any]) -> str:
    """Reward against samples trained, at four points of the run."""
    pts = r["per_sample"]
    picks = sorted({max(0, min(len(pts) - 1, round(f * (len(pts) - 1)))) for f in (0.0, 0.33, 0.66, 1.0)})
    return ", ".join(f"{pts[i][0]:.0f}: {pts[i][1]:.3f}" for i in picks)
