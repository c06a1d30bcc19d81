"""The step loop's hand-overs: how soon the trainer sees a batch the orchestrator renamed into place, how often it
reads `rollouts/DONE` meanwhile, and the orchestrator's `timing/policy_ready_s` (bench/STEP-OVERHEAD.md)."""

from __future__ import annotations

import os
import statistics
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from tidal.orchestrator.collect import policy_ready
from tidal.paths import STABLE, broadcast_dir
from tidal.transport import filesystem
from tidal.transport.batch import TrainingBatch
from tidal.transport.filesystem import BatchReader, BatchWriter


def batch(step: int) -> TrainingBatch:
    rng = np.random.default_rng()
    n = int(rng.integers(20, 60))
    return TrainingBatch(step=step, temperature=1.0, tokens=rng.integers(0, 100, n), lengths=np.array([n]),
                         loss_mask=rng.random(n) > 0.5, inference_logprobs=-rng.random(n),
                         advantages=rng.normal(size=n), rewards=rng.random(1), policy_steps=np.array([step - 1]))


def test_a_renamed_batch_reaches_the_waiting_trainer_within_milliseconds(tmp_path):
    """Mean latency from the rename to `wait` returning, over 20 hand-overs: ~2.5 ms polling every 5 ms; the old
    50 ms poll averaged ~25 ms (and fails this)."""
    writer, reader, lags = BatchWriter(tmp_path), BatchReader(tmp_path), []
    for step in range(1, 21):
        written: list[float] = []

        def put(s: int = step, out: list[float] = written) -> None:
            time.sleep(0.013 + 0.007 * (s % 5))  # lands anywhere in the reader's poll period
            writer.write(batch(s))
            out.append(time.monotonic())

        t = threading.Thread(target=put)
        t.start()
        got = reader.wait(step, timeout_s=5)
        lags.append(time.monotonic() - written[0] if written else 0.0)
        t.join()
        assert got is not None and got.step == step
    assert statistics.mean(lags) < 0.015, [round(x * 1000, 1) for x in lags]


def test_done_is_read_a_few_times_a_second_not_every_poll_and_still_ends_the_wait(tmp_path, monkeypatch):
    reads = []
    real = BatchReader.done_step

    def counted(self: BatchReader) -> int | None:
        reads.append(time.monotonic())
        return real(self)

    monkeypatch.setattr(BatchReader, "done_step", counted)
    writer = BatchWriter(tmp_path)
    threading.Timer(0.6, writer.finish, args=(2,)).start()  # the orchestrator finishes while the trainer waits
    start = time.monotonic()
    assert BatchReader(tmp_path).wait(3, timeout_s=5) is None
    took = time.monotonic() - start
    assert 0.6 <= took < 0.6 + filesystem.DONE_EVERY_S + 0.2
    assert len(reads) <= took / filesystem.DONE_EVERY_S + 2, f"{len(reads)} reads of DONE in {took:.2f} s"


def test_policy_ready_is_the_age_of_the_served_policys_stable_marker(tmp_path):
    d = broadcast_dir(tmp_path, 4)
    d.mkdir(parents=True)
    (d / STABLE).write_text("")
    published = time.time() - 1.5
    os.utime(d / STABLE, (published, published))
    got = policy_ready(SimpleNamespace(run_dir=tmp_path, step=4))  # type: ignore[arg-type]
    assert got["timing/policy_ready_s"] == pytest.approx(1.5, abs=0.2)
    assert policy_ready(SimpleNamespace(run_dir=tmp_path, step=0)) == {}  # type: ignore[arg-type]  # the base
    assert policy_ready(SimpleNamespace(run_dir=tmp_path, step=5)) == {}  # type: ignore[arg-type]  # not there
