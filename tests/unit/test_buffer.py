"""The example buffer: dedupe by `hash_keys`, difficulty pools with thresholds and promotion fractions, group
filters (online difficulty filtering, DAPO dynamic sampling)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from tidal.config.orch import OrchConfig
from tidal.envs.base import Example
from tidal.orchestrator.buffer import Buffer, example_key


class Finite:
    """A dataset of `n` examples drawn uniformly."""

    def __init__(self, n: int) -> None:
        self.items = [Example(prompt=[{"role": "user", "content": f"q{i}"}], answer=str(i), task="t")
                      for i in range(n)]

    def sample(self, rng: random.Random) -> Example:
        ex = rng.choice(self.items)
        return Example(prompt=ex.prompt, answer=ex.answer, task=ex.task)


def buffer(**kw) -> Buffer:
    cfg = OrchConfig.model_validate({"buffer": kw.pop("buffer", {}), **kw})
    b = Buffer(cfg.buffer, cfg.dynamic_sampling)
    b.new_step()
    return b


def test_one_batch_never_holds_an_example_twice():
    b, src, rng = buffer(), Finite(20), random.Random(0)
    keys = [example_key(b.draw(src, rng), ["task", "prompt"]) for _ in range(20)]
    assert len(set(keys)) == 20 and b.counts["buffer/duplicates_skipped"] > 0
    b.new_step()
    again = [example_key(b.draw(src, rng), ["task", "prompt"]) for _ in range(20)]
    assert len(set(again)) == 20  # a new batch may repeat earlier ones


def test_hash_keys_choose_what_counts_as_the_same_example():
    a = Example(prompt=[{"role": "user", "content": "x"}], answer="1", task="t")
    b = Example(prompt=[{"role": "user", "content": "x"}], answer="2", task="t")
    assert example_key(a, ["task", "prompt"]) == example_key(b, ["task", "prompt"])
    assert example_key(a, ["prompt", "answer"]) != example_key(b, ["prompt", "answer"])


def test_easy_and_hard_pools_are_not_drawn_again_and_fractions_promote_on_resume():
    b, src, rng = buffer(buffer={"easy_threshold": 0.9, "hard_threshold": 0.1}), Finite(10), random.Random(1)
    for ex, r in zip(src.items, itertools.cycle([1.0, 0.0, 0.5]), strict=False):
        assert b.judge(ex, np.full(4, r))  # no group filter: pools only
    assert len(b.easy) == 4 and len(b.hard) == 3
    for _ in range(5):
        b.new_step()
        drawn = {b.draw(src, rng).answer for _ in range(3)}
        assert drawn <= {"2", "5", "8"}
    state = b.state()
    c = buffer(buffer={"easy_threshold": 0.9, "hard_threshold": 0.1, "easy_fraction": 0.5, "hard_fraction": 1.0})
    c.load_state(state)
    assert len(c.easy) == 2 and len(c.hard) == 0 and c.easy < b.easy


@pytest.mark.parametrize("kw,rewards,keep", [
    ({}, [1, 1, 1, 1], True),
    ({"buffer": {"online_difficulty_filtering": True}}, [1, 1, 1, 1], False),
    ({"buffer": {"online_difficulty_filtering": True}}, [0, 0, 0, 0], False),
    ({"buffer": {"online_difficulty_filtering": True}}, [0.5, 0.5, 0.5, 0.5], True),
    ({"buffer": {"online_difficulty_filtering": True}}, [1, 0, 1, 1], True),
    ({"dynamic_sampling": True}, [0.5, 0.5, 0.5, 0.5], False),
    ({"dynamic_sampling": True}, [0.5, 0.5, 0.5, 0.7], True),
])
def test_group_filters(kw, rewards, keep):
    b = buffer(**kw)
    assert b.judge(Example(prompt=[]), np.array(rewards, dtype=float)) is keep
    assert b.filtering is bool(kw)


def test_threshold_order_is_checked():
    with pytest.raises(ValueError, match="hard_threshold .* must be below"):
        OrchConfig.model_validate({"buffer": {"easy_threshold": 0.2, "hard_threshold": 0.5}})
