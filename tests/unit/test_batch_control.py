"""The control values the trainer decides on, typed on `TrainingBatch` (issue 61): `policy_step` (from
`policy_steps`), `off_policy_level` (from `token_versions`, else `policy_steps` / `policy_steps_end`) and `max_steps`
(in the safetensors metadata), checked against a plain-Python reference on fresh random batches, and round-tripped
through both encodings (file and zmq bytes; safetensors, no pickle)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from tidal.transport.batch import BatchFormatError, TrainingBatch


def random_batch(rng: np.random.Generator, step: int, partial: bool, max_steps: int | None) -> TrainingBatch:
    n = int(rng.integers(1, 6))
    lengths = rng.integers(3, 9, n)
    prompt = [int(rng.integers(1, ln)) for ln in lengths]
    mask = np.concatenate([np.r_[np.zeros(p), np.ones(ln - p)] for p, ln in zip(prompt, lengths, strict=True)])
    starts = rng.integers(max(step - 4, 0), step, n)
    ends = np.minimum(starts + rng.integers(0, 2, n), step - 1)
    versions = None
    if partial:  # each sample's tokens from its start version, rising to its end version along the completion
        versions = np.concatenate([np.r_[np.full(p, s), np.sort(rng.integers(s, e + 1, ln - p))]
                                   for p, ln, s, e in zip(prompt, lengths, starts, ends, strict=True)])
    total = int(lengths.sum())
    return TrainingBatch(step=step, temperature=1.0, tokens=rng.integers(0, 50, total), lengths=lengths,
                         loss_mask=mask, inference_logprobs=-rng.random(total), advantages=rng.normal(size=total),
                         rewards=rng.random(n), policy_steps=starts, policy_steps_end=ends, token_versions=versions,
                         max_steps=max_steps, metrics={"samples": n})


def reference(b: TrainingBatch) -> tuple[int, int]:
    """(policy_step, off_policy_level) by hand: the oldest start; the oldest trained token's lag behind step - 1."""
    starts, ends = [int(x) for x in b.policy_steps], [int(x) for x in b.policy_steps_end]
    if b.token_versions is not None:
        oldest = min(int(v) for v, m in zip(b.token_versions, b.loss_mask, strict=True) if m)
        return min(starts), b.step - 1 - oldest
    return min(starts), max(b.step - 1 - min(starts), int(any(s != e for s, e in zip(starts, ends, strict=True))))


@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial_rollouts"])
def test_control_values_follow_the_arrays_and_round_trip(tmp_path, partial):
    seed = random.randrange(2**31)
    rng = np.random.default_rng(seed)
    for k in range(20):
        step = int(rng.integers(1, 30))
        b = random_batch(rng, step, partial, None if k % 3 == 0 else int(rng.integers(step, 100)))
        assert (b.policy_step, b.off_policy_level) == reference(b), seed
        b.save(tmp_path / "b.safetensors")
        for back in (TrainingBatch.load(tmp_path / "b.safetensors"), TrainingBatch.from_bytes(b.to_bytes())):
            assert (back.policy_step, back.off_policy_level, back.max_steps) == \
                (b.policy_step, b.off_policy_level, b.max_steps), seed
            assert back.metrics == {"samples": b.num_samples}, "the control values are not metric strings"


def test_an_on_policy_batch_is_level_0_and_an_empty_one_trains_nothing():
    rng = np.random.default_rng(0)
    b = random_batch(rng, 5, False, 9)
    b.policy_steps[:] = 4
    b.policy_steps_end = np.full_like(b.policy_steps, 4)
    assert b.off_policy_level == 0 and b.policy_step == 4
    b.policy_steps_end[0] = 5  # (not reachable from a real orchestrator, but a changed request counts as lag 1)
    assert b.off_policy_level == 1
    empty = TrainingBatch(step=7, temperature=1.0, tokens=np.zeros(0), lengths=np.zeros(0), loss_mask=np.zeros(0),
                          inference_logprobs=np.zeros(0), advantages=np.zeros(0), rewards=np.zeros(0),
                          policy_steps=np.zeros(0))
    assert empty.policy_step == 6 and empty.off_policy_level == 0 and empty.max_steps is None


def test_a_malformed_max_steps_is_a_format_error():
    b = random_batch(np.random.default_rng(1), 3, False, 8)
    data = b.to_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["__metadata__"]["max_steps"] = '"ten"'
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors keeps the header 8-byte aligned
    with pytest.raises(BatchFormatError, match="max_steps 'ten' is not an integer or null"):
        TrainingBatch.from_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])
