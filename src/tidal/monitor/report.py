"""`tidal report RUN_DIR`: one self-contained HTML file with the run's curves, samples and configs.

Reads `metrics.jsonl` (trainer + orchestrator metrics per step), `samples.jsonl` (prompt/completion/reward
samples the orchestrator keeps) and `configs/*.yaml`; draws the curves with matplotlib (Agg backend) into
PNGs embedded as base64, so the file opens anywhere with no server and no network. Written temp + rename to
`RUN_DIR/report.html`; the trainer writes it at the end of every run.
"""

from __future__ import annotations

import base64
import html
import io
import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tidal.monitor.metrics import read_metrics
from tidal.paths import configs_dir, metrics_path, report_path, samples_path, write_atomic

# (title, [(metric key, label)], log-scale)
PANELS: list[tuple[str, list[tuple[str, str]], bool]] = [
    ("Reward", [("reward/mean", "mean reward")], False),
    ("KL and trainer/inference mismatch", [("mismatch_kl", "mismatch_kl"), ("kl", "kl to reference")], True),
    ("Masked fraction", [("masked", "masked"), ("clip_ratio/region_mean", "clipped")], False),
    ("Loss", [("loss", "loss")], False),
    ("Gradient norm", [("grad_norm", "grad norm")], False),
    ("Throughput (tokens/s)", [("rollout_tokens_per_s", "rollout (vLLM)"),
                               ("trainer_tokens_per_s", "trainer")], False),
    ("Step time split (s)", [("step_time_s", "step"), ("rollout_time_s", "rollout"), ("train_time_s", "train"),
                             ("wait_time_s", "trainer waiting"), ("broadcast_time_s", "broadcast")], False),
    ("Completion length (tokens)", [("completions/mean_length", "mean"), ("completions/max_length", "max")],
     False),
]

STYLE = """body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1300px}
h1{margin-bottom:0}.sub{color:#666;margin-top:.3em}.grid{display:grid;grid-template-columns:1fr 1fr;gap:1em}
.grid img{width:100%;border:1px solid #ddd}table{border-collapse:collapse;font-size:13px;width:100%}
td,th{border:1px solid #ddd;padding:4px 6px;vertical-align:top;text-align:left}
td.t{font-family:monospace;white-space:pre-wrap;max-width:480px;word-break:break-all}
pre{background:#f6f6f6;padding:1em;overflow:auto;font-size:12px}table.kv{width:auto}
.kv td{border:none;padding:2px 16px 2px 0}"""


def _series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, int | float) and v == v:  # skips None and NaN
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def _import_matplotlib() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401 - the import is the work
    import matplotlib.ticker  # noqa: F401


def preload() -> threading.Thread:
    """Import matplotlib (Agg) and pyplot in a daemon thread, now: the trainer calls it when it is ready and waits for
    its first batch (through vLLM's start), so the import (0.5-1 s on 2 CPU cores) is not paid after the last step,
    where the report is drawn (issue 68: the end of a run). `_panel`'s own imports then find the modules loaded, or
    wait on Python's import lock until the thread has loaded them."""
    thread = threading.Thread(target=_import_matplotlib, name="tidal-report-preload", daemon=True)
    thread.start()
    return thread


def _panel(rows: Sequence[dict[str, Any]], title: str, keys: list[tuple[str, str]], log: bool) -> str | None:
    """One PNG (base64) for a panel, or None when the run has none of its metrics."""
    _import_matplotlib()
    import matplotlib
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=100)
    drawn = 0
    for key, label in keys:
        xs, ys = _series(rows, key)
        if not xs or (log and not any(y > 0 for y in ys)):
            continue
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, ms=3, label=label)
        if key == "reward/mean":
            _, std = _series(rows, "reward/std")
            if len(std) == len(ys):
                ax.fill_between(xs, [y - s for y, s in zip(ys, std, strict=True)],
                                [y + s for y, s in zip(ys, std, strict=True)], alpha=0.2, label="± std")
        drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    if log:
        ax.set_yscale("symlog", linthresh=1e-6)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _samples_table(path: Path, limit: int = 40) -> str:
    if not path.is_file():
        return "<p>No samples recorded (samples.jsonl is missing).</p>"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][-limit:]
    cells = "".join(
        f"<tr><td>{r.get('step')}</td><td class=t>{html.escape(str(r.get('prompt', '')))}</td>"
        f"<td class=t>{html.escape(str(r.get('completion', '')))}</td><td>{float(r.get('reward', 0)):.3f}</td>"
        f"<td>{float(r.get('advantage', 0)):+.3f}</td></tr>" for r in rows)
    return ("<table><tr><th>step</th><th>prompt</th><th>completion</th><th>reward</th><th>advantage</th></tr>"
            f"{cells}</table>")


def _summary(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return "<p>No steps recorded yet.</p>"
    k = max(1, min(5, len(rows) // 2))
    first = sum(r.get("reward/mean", 0.0) for r in rows[:k]) / k
    last = sum(r.get("reward/mean", 0.0) for r in rows[-k:]) / k
    step_times = [r["step_time_s"] for r in rows if isinstance(r.get("step_time_s"), int | float)]
    items = [("steps", str(len(rows))), (f"reward, first {k} steps", f"{first:.3f}"),
             (f"reward, last {k} steps", f"{last:.3f} ({last - first:+.3f})")]
    if step_times:
        items += [("mean step time", f"{sum(step_times) / len(step_times):.2f} s"),
                  ("training time (sum of steps)", f"{sum(step_times):.0f} s")]
    return "<table class=kv>" + "".join(f"<tr><td>{a}</td><td><b>{b}</b></td></tr>" for a, b in items) + "</table>"


def render(run_dir: Path) -> str:
    """The report's HTML for `run_dir` (see module doc)."""
    metrics = metrics_path(run_dir)
    rows = read_metrics(metrics) if metrics.is_file() else []
    images = [img for title, keys, log in PANELS if (img := _panel(rows, title, keys, log))]
    grid = "".join(f'<img alt="plot" src="data:image/png;base64,{img}">' for img in images)
    configs = "".join(
        f"<h3>{html.escape(p.name)}</h3><pre>{html.escape(p.read_text())}</pre>"
        for p in sorted(configs_dir(run_dir).glob("*.yaml"))) or "<p>No resolved configs in configs/.</p>"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return (f"<!doctype html><html><head><meta charset=utf-8><title>tidal run {html.escape(run_dir.name)}</title>"
            f"<style>{STYLE}</style></head><body><h1>tidal run report</h1>"
            f"<p class=sub>{html.escape(str(run_dir.resolve()))} · written {stamp}</p>{_summary(rows)}"
            f"<h2>Curves</h2><div class=grid>{grid or '<p>No metrics yet.</p>'}</div>"
            f"<h2>Samples</h2>{_samples_table(samples_path(run_dir))}<h2>Resolved configs</h2>{configs}"
            "</body></html>")


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Render and write atomically (`tidal.paths.write_atomic`); returns the path."""
    out = out or report_path(run_dir)
    write_atomic(out, render(run_dir))
    return out
