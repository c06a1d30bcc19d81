"""The run report and the metric sinks: real matplotlib PNGs, real TensorBoard event files read back, a real
offline W&B run (no network)."""

from __future__ import annotations

import base64
import json
import re
import time

import numpy as np

from tidal.config.orch import ReportSection
from tidal.monitor.metrics import MetricsWriter
from tidal.monitor.report import PANELS, write_report
from tidal.monitor.sinks import MetricsTail, Sinks


def fake_run(tmp_path, steps: int = 6):
    rng = np.random.default_rng()
    w = MetricsWriter(tmp_path / "metrics.jsonl")
    rows = []
    for s in range(1, steps + 1):
        row = {"step": s, "reward/mean": float(rng.random()), "reward/std": 0.1, "mismatch_kl": 1e-4 * s,
               "masked": 0.01, "loss": float(rng.normal()), "grad_norm": 0.5, "rollout_tokens_per_s": 100.0,
               "trainer_tokens_per_s": 900.0, "step_time_s": 2.0, "rollout_time_s": 1.5, "train_time_s": 1.0,
               "completions/mean_length": 12.0, "note": "text values are skipped"}
        w.write(row)
        rows.append(row)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "orch.yaml").write_text("batch_size: 16\n")
    MetricsWriter(tmp_path / "samples.jsonl").write(
        {"step": 1, "prompt": "<script>alert(1)</script>", "completion": "abc", "reward": 0.5, "advantage": 0.1})
    return rows


def test_report_embeds_one_png_per_panel_and_escapes_text(tmp_path):
    fake_run(tmp_path)
    out = write_report(tmp_path)
    text = out.read_text()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', text)
    assert len(images) == len(PANELS)  # every panel has at least one of its metrics here
    for img in images:
        assert base64.b64decode(img)[:8] == b"\x89PNG\r\n\x1a\n"
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text and "<script>" not in text
    assert "batch_size: 16" in text and "steps</td><td><b>6</b>" in text
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "no temp file left"


def test_metrics_tail_reads_only_whole_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    tail = MetricsTail(path)
    assert tail.poll() == []
    path.write_text('{"step": 1}\n{"step": 2')
    assert tail.poll() == [{"step": 1}]
    with open(path, "a") as f:
        f.write(', "x": 3}\n')
    assert tail.poll() == [{"step": 2, "x": 3}] and tail.last_step == 2


def test_tensorboard_sink_writes_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = fake_run(tmp_path)
    sinks = Sinks(ReportSection(wandb=False), tmp_path, {})
    sinks.record_samples(1, [{"prompt": "p", "completion": "c", "reward": 1.0, "advantage": 0.5}],
                         np.array([1.0, 0.0]), np.array([0.5, -0.5]))
    sinks.close(last_step=len(rows), timeout_s=5)
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    got = [e.value for e in acc.Scalars("reward/mean")]
    assert np.allclose(got, [r["reward/mean"] for r in rows])
    assert "distributions/reward" in acc.Tags()["histograms"]


def test_wandb_offline_sink_needs_no_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    rows = fake_run(tmp_path, steps=3)
    sinks = Sinks(ReportSection(offline=True, tensorboard=False, project="tidal-test"), tmp_path, {"a": 1})
    sinks.record_samples(3, [{"prompt": "p", "completion": "c", "reward": 1.0, "advantage": 0.5}],
                         np.array([1.0, 0.0]), np.array([0.5, -0.5]))
    sinks.close(last_step=3, timeout_s=5)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # the offline log holds each history record's values as JSON text (W&B's transaction log, protobuf);
    # W&B's service may still be appending its last records when finish() returns
    log_file = next(runs[0].glob("run-*.wandb"))
    for _ in range(100):
        raw = log_file.read_bytes()
        if b"distributions/reward" in raw:
            break
        time.sleep(0.2)
    for r in rows:
        assert json.dumps(r["reward/mean"]).encode() in raw
    assert b"distributions/reward" in raw and b"reward/mean" in raw
    assert list(runs[0].rglob("samples_*.table.json")), "the samples table was logged"


def test_preload_imports_matplotlib_in_a_thread_and_the_report_then_draws(tmp_path):
    """`preload` (the trainer calls it when ready): a fresh interpreter without pyplot has it, on Agg, once the
    daemon thread ends, and a report written afterwards still has every panel."""
    import subprocess
    import sys

    fake_run(tmp_path)
    code = ("import sys\n"
            "from pathlib import Path\n"
            "from tidal.monitor.report import preload, write_report\n"
            "assert 'matplotlib.pyplot' not in sys.modules\n"
            "t = preload()\n"
            "assert t.daemon\n"
            "t.join(120)\n"
            "assert not t.is_alive()\n"
            "import matplotlib\n"
            "print(matplotlib.get_backend().lower(), 'matplotlib.pyplot' in sys.modules)\n"
            f"print(write_report(Path({str(tmp_path)!r})).read_text().count('data:image/png'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["agg", "True", str(len(PANELS))]
