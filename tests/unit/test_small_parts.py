"""The reverse-text reward, batch transport and the LR schedule."""

from __future__ import annotations

import numpy as np
import pytest

from tidal.config.train import TrainConfig
from tidal.envs import make_env
from tidal.envs.reverse_text import extract_answer, similarity
from tidal.trainer.step.optim import lr_factor
from tidal.transport.batch import BatchFormatError, TrainingBatch
from tidal.transport.filesystem import BatchReader, BatchWriter


def test_reverse_text_reward():
    env = make_env("reverse-text")
    ex = env.sample(__import__("random").Random(0))
    assert env.reward(ex, env.reference_completion(ex)) == 1.0
    assert env.reward(ex, ex.answer) == 0.0  # no tags: no answer
    assert extract_answer("x<reversed_text>abc") == "abc"  # unclosed tag takes the rest
    assert similarity("abcd", "abdc") == pytest.approx(0.75)
    with pytest.raises(ValueError, match="unknown environment id 'nope'.*reverse-text"):
        make_env("nope")


def test_reverse_text_examples_are_deterministic_and_in_range():
    env = make_env("reverse-text", {"min_len": 5, "max_len": 9})
    a = [env.sample(__import__("random").Random(7)).info["text"] for _ in range(3)]
    assert len(set(a)) == 1
    for seed in range(50):
        text = env.sample(__import__("random").Random(seed)).info["text"]
        assert 1 <= len(text) <= 9 and text == text.strip()


def make_batch(step: int = 3) -> TrainingBatch:
    rng = np.random.default_rng()
    lengths = np.array([5, 7, 4])
    return TrainingBatch(step=step, temperature=0.9, tokens=rng.integers(0, 100, 16), lengths=lengths,
                         loss_mask=(rng.random(16) > 0.5), inference_logprobs=-rng.random(16),
                         advantages=rng.normal(size=16), rewards=rng.random(3), policy_steps=np.array([1, 1, 2]),
                         truncated=np.array([0, 1, 0]), teacher_logprobs=-rng.random(16), max_tokens=48,
                         metrics={"reward/mean": 0.5})


def test_batch_roundtrip_through_filesystem_transport(tmp_path):
    batch = make_batch()
    path = BatchWriter(tmp_path).write(batch)
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no temp files left behind"
    got = BatchReader(tmp_path).wait(3, timeout_s=1)
    assert got is not None and got.step == 3 and got.temperature == 0.9 and got.metrics == {"reward/mean": 0.5}
    assert got.max_tokens == 48
    for k in ("tokens", "lengths", "loss_mask", "inference_logprobs", "advantages", "rewards", "policy_steps",
              "truncated", "teacher_logprobs"):
        assert np.array_equal(getattr(got, k), getattr(batch, k)), k


def test_reader_stops_at_done_and_times_out(tmp_path):
    w = BatchWriter(tmp_path)
    w.finish(2)
    assert BatchReader(tmp_path).wait(3, timeout_s=1) is None
    with pytest.raises(TimeoutError, match="no batch 2"):
        BatchReader(tmp_path).wait(2, timeout_s=0.2)


def test_corrupt_batch_file_error_names_the_file(tmp_path):
    (tmp_path / "rollouts").mkdir()
    bad = tmp_path / "rollouts" / "step_1.safetensors"
    bad.write_bytes(b"\x00garbage")
    with pytest.raises(BatchFormatError, match="step_1.safetensors"):
        BatchReader(tmp_path).wait(1, timeout_s=1)


def test_inconsistent_batch_is_rejected():
    with pytest.raises(ValueError, match="lengths sum"):
        TrainingBatch(step=1, temperature=1.0, tokens=np.zeros(3), lengths=np.array([2, 2]), loss_mask=np.zeros(3),
                      inference_logprobs=np.zeros(3), advantages=np.zeros(3), rewards=np.zeros(2),
                      policy_steps=np.zeros(2))


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_lr_schedule_warmup_then_shape(kind):
    cfg = TrainConfig(model="m", lr_scheduler_type=kind, warmup_steps=4)
    f = [lr_factor(s, cfg.lr_scheduler_type, cfg.warmup_steps, 20) for s in range(20)]
    assert f[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert f[4] == pytest.approx(1.0)
    if kind == "constant":
        assert f[-1] == 1.0
    else:
        assert all(a >= b for a, b in zip(f[4:], f[5:], strict=False)) and f[-1] < 0.1


def test_metrics_writer_writes_one_json_object_per_line_without_nan(tmp_path):
    from tidal.monitor.metrics import MetricsWriter, read_metrics

    w = MetricsWriter(tmp_path / "m.jsonl")
    w.write({"step": 1, "loss": float("nan"), "x": 1.5})
    w.write({"step": 2, "loss": 0.25})
    assert read_metrics(tmp_path / "m.jsonl") == [{"step": 1, "loss": None, "x": 1.5}, {"step": 2, "loss": 0.25}]
