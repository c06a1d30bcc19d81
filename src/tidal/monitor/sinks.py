"""Metric sinks fed by the orchestrator: TensorBoard and Weights & Biases (`report_to`), plus `samples.jsonl`.

The trainer is the one writer of `metrics.jsonl`; the orchestrator tails it (`MetricsTail`) and forwards every
new step to the configured sinks, together with what only it has: prompt/completion/reward samples and the
reward/advantage distributions, every `report_to.interval` steps. At the end it waits (bounded) for the
trainer's last step so the sinks get the whole run. W&B runs offline with `report_to.offline: true` (no
network; `wandb sync` later); its files and TensorBoard's go under the run directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from tidal.config.orch import ReportSection
from tidal.monitor.metrics import MetricsWriter
from tidal.paths import metrics_path, samples_path, tensorboard_dir

log = logging.getLogger("tidal.orch")


class MetricsTail:
    """New complete records appended to a jsonl file since the last poll."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.last_step, self.inode = path, 0, 0, -1

    def poll(self) -> list[dict[str, Any]]:
        """New records. When a resuming trainer rewrote the file (new inode), it is read again from the start;
        steps already seen are then skipped unless they come after a rewind (a resumed step is new data)."""
        try:
            with open(self.path, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                if inode != self.inode:
                    self.inode, self.offset, rewound = inode, 0, self.inode != -1
                else:
                    rewound = False
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # only whole lines; a partial last line is read next time
        self.offset += end
        rows = []
        for line in data[:end].decode().splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
        if rewound:
            top = max((int(r.get("step", 0)) for r in rows), default=0)
            self.last_step = min(self.last_step, top)
            rows = []  # the rewritten file holds steps already forwarded
        if rows:
            self.last_step = int(rows[-1].get("step", self.last_step))
        return rows


class TensorBoardWriter:
    """TensorBoard event files through the `tensorboard` package's own event writer and protobufs, so the
    orchestrator stays torch-free (`torch.utils.tensorboard` would load torch). Scalars and histograms in the
    classic summary form (what `torch.utils.tensorboard` writes), text through the text plugin's builder."""

    def __init__(self, log_dir: Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = EventFileWriter(str(log_dir))

    def _add(self, summary: Any, step: int) -> None:
        from tensorboard.compat.proto import event_pb2

        self.writer.add_event(event_pb2.Event(summary=summary, step=int(step), wall_time=time.time()))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        from tensorboard.compat.proto import summary_pb2

        self._add(summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=float(value))]), step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        from tensorboard.plugins.text.summary_v2 import text_pb

        self._add(text_pb(tag, text), step)

    def add_histogram(self, tag: str, values: np.ndarray, step: int, bins: int = 30) -> None:
        from tensorboard.compat.proto import summary_pb2

        v = np.asarray(values, dtype=np.float64).reshape(-1)
        if v.size == 0:
            return
        counts, edges = np.histogram(v, bins=bins)
        histo = summary_pb2.HistogramProto(min=float(v.min()), max=float(v.max()), num=float(v.size),
                                           sum=float(v.sum()), sum_squares=float((v * v).sum()),
                                           bucket_limit=edges[1:].tolist(), bucket=counts.astype(float).tolist())
        self._add(summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, histo=histo)]), step)

    def close(self) -> None:
        self.writer.close()


class Sinks:
    """Fan-out to TensorBoard / W&B per `report_to`; `samples.jsonl` always."""

    def __init__(self, cfg: ReportSection | None, run_dir: Path, config: dict[str, Any]) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.samples_file = MetricsWriter(samples_path(run_dir))
        self.tail = MetricsTail(metrics_path(run_dir))
        self.tb: Any = None
        self.wandb: Any = None
        self.pending: dict[int, dict[str, Any]] = {}  # W&B needs increasing steps: samples wait for metrics
        if cfg is None:
            return
        if cfg.tensorboard:
            self.tb = TensorBoardWriter(tensorboard_dir(run_dir))
        if cfg.wandb:
            import wandb

            self.wandb = wandb.init(project=cfg.project, name=cfg.name or run_dir.name, dir=str(run_dir),
                                    mode="offline" if cfg.offline else "online", config=config)

    @property
    def interval(self) -> int:
        return self.cfg.interval if self.cfg is not None else 10

    def due(self, step: int) -> bool:
        return step == 1 or step % self.interval == 0

    def forward_metrics(self) -> int:
        """Send the trainer's new step records to the sinks; returns the newest step seen."""
        for row in self.tail.poll():
            step = int(row["step"])
            scalars = {k: float(v) for k, v in row.items()
                       if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and np.isfinite(v)}
            if self.tb is not None:
                for k, v in scalars.items():
                    self.tb.add_scalar(k, v, step)
            if self.wandb is not None:
                self.wandb.log({**scalars, **self.pending.pop(step, {})}, step=step)
        return self.tail.last_step

    def record_samples(self, step: int, samples: list[dict[str, Any]], rewards: np.ndarray,
                       advantages: np.ndarray) -> None:
        """Samples and distributions of batch `step` (call when `due(step)`)."""
        for s in samples:
            self.samples_file.write({"step": step, **s})
        if self.cfg is None:
            return
        if self.cfg.samples is not False and samples:
            if self.tb is not None:
                text = "\n\n".join(f"**reward {s['reward']:.3f}** `{s['prompt']}` → `{s['completion']}`"
                                   for s in samples)
                self.tb.add_text("samples", text, step)
            if self.wandb is not None:
                import wandb

                table = wandb.Table(columns=["step", "prompt", "completion", "reward", "advantage"],
                                    data=[[step, s["prompt"], s["completion"], s["reward"], s["advantage"]]
                                          for s in samples])
                self.pending.setdefault(step, {})["samples"] = table
        if self.cfg.distributions is not False:
            if self.tb is not None:
                self.tb.add_histogram("distributions/reward", rewards, step)
                self.tb.add_histogram("distributions/advantage", advantages, step)
            if self.wandb is not None:
                import wandb

                self.pending.setdefault(step, {}).update({
                    "distributions/reward": wandb.Histogram(rewards.tolist()),
                    "distributions/advantage": wandb.Histogram(advantages.tolist())})

    def record_eval(self, metrics: dict[str, Any]) -> None:
        """An evaluation's metrics (already in `eval.jsonl`) to TensorBoard at its step, and to W&B with the
        next trainer record it logs (W&B steps must increase)."""
        scalars = {k: float(v) for k, v in metrics.items() if k.startswith("eval/") and isinstance(v, int | float)}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, int(metrics["step"]))
        if self.wandb is not None:
            self.pending.setdefault(max(int(metrics["step"]), self.tail.last_step + 1), {}).update(scalars)

    def close(self, last_step: int | None, timeout_s: float = 120.0) -> None:
        """Wait up to `timeout_s` for the trainer's record of `last_step`, forward it, close the sinks."""
        if self.cfg is not None and last_step:
            start = time.monotonic()
            while self.forward_metrics() < last_step and time.monotonic() - start < timeout_s:
                time.sleep(0.2)
            if self.tail.last_step < last_step:
                log.warning("sinks closed before the trainer recorded step %d (newest: %d)", last_step,
                            self.tail.last_step)
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            for step in sorted(s for s in self.pending if s > self.tail.last_step):
                self.wandb.log(self.pending[step], step=step)
            self.wandb.finish()
