"""`tidal.monitor.eval_metrics`: pass@k against exhaustive enumeration, the Wilson interval against its closed form
and published values, the bootstrap's determinism and coverage, `summarize`'s keys and shapes."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from tidal.monitor.eval_metrics import bootstrap, ks_up_to, pass_at_k, per_example_pass_at_k, summarize, wilson


def brute_pass_at_k(correct: list[bool], k: int) -> Fraction:
    """The share of k-subsets of the completions holding a correct one (exact)."""
    subsets = list(itertools.combinations(range(len(correct)), k))
    return Fraction(sum(any(correct[i] for i in s) for s in subsets), len(subsets))


def test_pass_at_k_equals_exhaustive_enumeration_on_random_inputs():
    rng = np.random.default_rng()
    for _ in range(200):
        n = int(rng.integers(1, 11))
        correct = [bool(x) for x in rng.random(n) < rng.random()]
        for k in range(1, n + 1):
            assert pass_at_k(n, sum(correct), k) == pytest.approx(float(brute_pass_at_k(correct, k)), abs=1e-12)


def test_pass_at_k_edges_and_its_meaning_at_k_1_and_k_n():
    assert pass_at_k(8, 0, 3) == 0.0 and pass_at_k(8, 8, 1) == 1.0 and pass_at_k(8, 6, 3) == 1.0
    c = np.array([[True, False, False, False], [False] * 4, [True] * 4])
    assert per_example_pass_at_k(c, 1).tolist() == pytest.approx([0.25, 0.0, 1.0])  # the share correct
    assert per_example_pass_at_k(c, 4).tolist() == [1.0, 0.0, 1.0]  # any of the 4: orch eval's pass@K
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_wilson_matches_the_closed_form_and_published_values():
    rng = np.random.default_rng()
    for _ in range(100):
        n = int(rng.integers(1, 500))
        s = int(rng.integers(0, n + 1))
        z = 1.959963984540054
        p = s / n
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        lo, hi = wilson(s, n)
        assert lo == pytest.approx(max(0.0, centre - half), abs=1e-12)
        assert hi == pytest.approx(min(1.0, centre + half), abs=1e-12)
        assert lo - 1e-12 <= p <= hi + 1e-12  # p = 0 or 1 sits on a bound
    assert wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)  # the textbook values
    assert wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    with pytest.raises(ValueError):
        wilson(3, 0)


def test_bootstrap_is_seeded_brackets_the_mean_and_narrows_with_more_examples():
    rng = np.random.default_rng()
    small, large = rng.random(30), rng.random(3000)
    assert bootstrap(small, seed=3) == bootstrap(small, seed=3)
    lo, hi = bootstrap(small, seed=3)
    assert lo <= small.mean() <= hi
    lo2, hi2 = bootstrap(large, seed=3)
    assert hi2 - lo2 < (hi - lo) / 3
    assert bootstrap(np.array([0.5])) == (0.5, 0.5)


def test_bootstrap_covers_the_true_mean_about_95_percent_of_the_time():
    rng = np.random.default_rng(12345)  # fixed: a coverage rate is a statistic, this keeps the test exact
    hits = sum(lo <= 0.3 <= hi for lo, hi in (bootstrap((rng.random(200) < 0.3).astype(float), resamples=400,
                                                        seed=i) for i in range(200)))
    assert 0.88 <= hits / 200 <= 0.99


def test_summarize_reports_every_k_with_intervals_and_checks_shapes():
    rewards = [[1.0, 0.0, 0.5], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0]]
    lengths = [[3, 5, 7], [2, 2, 2], [4, 4, 4], [9, 9, 9]]
    cut = [[False, False, True], [False] * 3, [False] * 3, [True] * 3]
    m = summarize(rewards, lengths, cut)
    assert m["examples"] == 4 and m["completions"] == 3
    assert m["reward/mean"] == pytest.approx(np.mean(rewards))
    assert m["accuracy"] == 0.5  # first completions correct: examples 0 and 2
    assert m["pass@1"] == pytest.approx((1 / 3 + 0 + 1 + 1 / 3) / 4)
    assert m["pass@3"] == 0.75 and "pass@4" not in m
    assert m["completion_len/mean"] == pytest.approx(np.mean(lengths)) and m["cut/share"] == pytest.approx(4 / 12)
    for key in ("reward/mean", "accuracy", "pass@1", "pass@2", "pass@3", "completion_len/mean", "cut/share"):
        assert m[f"{key}_lo"] <= m[key] <= m[f"{key}_hi"], key
    with pytest.raises(ValueError, match="must match"):
        summarize(rewards, lengths[:2], cut)
    assert ks_up_to(4) == [1, 2, 3, 4] and ks_up_to(40) == [1, 2, 4, 8, 16, 32, 40]
