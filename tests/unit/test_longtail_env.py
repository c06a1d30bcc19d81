"""reverse-text-longtail: its length laws (seeded, against the laws' closed forms within binomial bounds), the
texts it builds, its reward (stopping after k letters scores best) and its `args` checked when the config loads."""

from __future__ import annotations

import math
import random

import pytest

from tidal.config.environments import EnvSection, LongTailArgs
from tidal.config.orch import OrchConfig
from tidal.envs import available, make_env
from tidal.envs.longtail import draw_length

N = 20_000


def within(count: int, p: float, n: int = N) -> bool:
    """`count` of `n` draws is within 5 binomial standard deviations of n * p."""
    return abs(count - n * p) <= 5 * math.sqrt(n * p * (1 - p)) + 1


def lengths(rng_seed: int = 0, **args) -> list[int]:
    a, rng = LongTailArgs(**args), random.Random(rng_seed)
    return [draw_length(a, rng) for _ in range(N)]


def test_registered_and_seeded():
    assert "reverse-text-longtail" in available()
    env = make_env("reverse-text-longtail", {"median": 10})
    one = [env.sample(random.Random(7)) for _ in range(2)]
    assert one[0] == one[1]  # the RNG is the only randomness
    a, b = random.Random(3), random.Random(3)
    assert [env.sample(a).answer for _ in range(50)] == [env.sample(b).answer for _ in range(50)]


def test_lognormal_law():
    got = lengths(median=8, sigma=1.25, min_len=1, max_len=10_000)
    # P(round(X) >= x) = P(X >= x - 0.5) for lognormal X: ln X ~ N(ln 8, 1.25)
    for x in (4, 8, 16, 64, 200):
        p = 0.5 * math.erfc((math.log(x - 0.5) - math.log(8)) / (1.25 * math.sqrt(2)))
        assert within(sum(k >= x for k in got), p), (x, p, sum(k >= x for k in got) / N)
    assert sorted(got)[N // 2] == 8


def test_pareto_law():
    got = lengths(distribution="pareto", min_len=4, alpha=1.5, max_len=100_000)
    assert min(got) == 4
    for x in (8, 16, 64, 256):  # P(round(X) >= x) = P(X >= x - 0.5) = (4 / (x - 0.5)) ** 1.5
        p = (4 / (x - 0.5)) ** 1.5
        assert within(sum(k >= x for k in got), p), (x, p, sum(k >= x for k in got) / N)


def test_clipped_to_min_and_max():
    got = lengths(median=8, sigma=2.0, min_len=3, max_len=50)
    assert min(got) == 3 and max(got) == 50
    p_top = 0.5 * math.erfc((math.log(49.5) - math.log(8)) / (2.0 * math.sqrt(2)))
    assert within(got.count(50), p_top)  # every draw past max_len is clipped to it
    assert lengths(median=5, sigma=1.0, min_len=7, max_len=7) == [7] * N


@pytest.mark.parametrize("unit", [1, 2, 5])
def test_texts_repeat_a_unit_of_letters(unit):
    env, rng = make_env("reverse-text-longtail", {"unit": unit, "median": 30}), random.Random(1)
    for _ in range(200):
        ex = env.sample(rng)
        text = ex.info["text"]
        assert len(text) == ex.info["length"] and text.isalpha() and text.islower()
        assert ex.answer == text[::-1] and ex.prompt[-1] == {"role": "user", "content": text}
        assert any(text == (text[:u] * len(text))[:len(text)] for u in range(1, unit + 1))


def test_reward_is_best_when_stopping_after_k_letters():
    env = make_env("reverse-text-longtail")
    ex = env.sample(random.Random(0))
    target = ex.answer
    assert env.reward(ex, env.reference_completion(ex)) == 1.0
    assert env.reward(ex, f"no tags {target}") == 0.0
    # every letter too many or too few costs: the reward peaks at the right length and falls on both sides
    unit = target[-1] * 3
    longer = [env.reward(ex, f"<reversed_text>{target + unit * j}</reversed_text>") for j in range(0, 6)]
    assert longer == sorted(longer, reverse=True) and longer[0] > longer[1]
    k = len(target)
    shorter = [env.reward(ex, f"<reversed_text>{target[:k - j]}</reversed_text>") for j in range(0, min(k, 4))]
    assert shorter == sorted(shorter, reverse=True)
    # a completion that never stops (no closing tag, runs to max_tokens) scores by what it wrote
    runaway = env.reward(ex, "<reversed_text>" + target + "x" * 200)
    assert 0 < runaway < 0.2


def test_args_checked_when_the_config_loads():
    OrchConfig.model_validate({"env": [{"id": "reverse-text-longtail", "args": {"distribution": "pareto",
                                                                                "alpha": 1.1}}]})
    with pytest.raises(ValueError, match=r"args\.sigmaa: Extra inputs.*keys: distribution, median"):
        EnvSection(id="reverse-text-longtail", args={"sigmaa": 2})
    with pytest.raises(ValueError, match=r"min_len \(9\) must not exceed max_len \(4\)"):
        EnvSection(id="reverse-text-longtail", args={"min_len": 9, "max_len": 4})
    with pytest.raises(ValueError, match=r"args\.distribution"):
        make_env("reverse-text-longtail", {"distribution": "zipf"})
    with pytest.raises(ValueError, match=r"args\.alpha"):
        make_env("reverse-text-longtail", {"alpha": 0})


def test_bench_reads_vllm_running_sequences_from_metrics():
    """bench/longtail.py's `/metrics` reader: vLLM's gauges (per engine, summed) and the steady-state cut."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "longtail.py"
    spec = importlib.util.spec_from_file_location("bench_longtail", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    page = ('# HELP vllm:num_requests_running Number of requests in model execution batches.\n'
            '# TYPE vllm:num_requests_running gauge\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 37.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 5.0\n'
            'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0\n')
    assert mod.parse_gauges(page) == {"running": 40.0, "waiting": 5.0}
    assert mod.parse_gauges("process_cpu_seconds_total 3.0\n") == {}
    s = mod.Sampler(1, Path("/nonexistent"))
    s.samples = [(0.0, 1, 50.0, 0.0), (0.1, 2, 0.0, 0.0), (0.2, 2, 10.0, 1.0), (0.3, 4, 99.0, 0.0)]
    assert s.busy(2, 4) == {"busy": 0.5, "running": 5.0, "waiting": 0.5, "samples": 2.0}
