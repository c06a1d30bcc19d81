"""The addition environment of the real-model example (`tidal.envs.addition`)."""

from __future__ import annotations

import random

import pytest

from tidal.envs.addition import Addition, last_integer
from tidal.envs.registry import make_env


def test_reward_is_exact_match_of_the_last_integer():
    env = make_env("addition", {"low": 10, "high": 99})
    assert isinstance(env, Addition)
    ex = env.sample(random.Random(0))
    a, b = ex.info["a"], ex.info["b"]
    assert 10 <= a <= 99 and 10 <= b <= 99 and ex.answer == str(a + b)
    assert f"What is {a} + {b}?" in ex.prompt[-1]["content"]
    assert env.reward(ex, f"{a} + {b} = {a + b}") == 1.0
    assert env.reward(ex, f"The answer is {a + b}.") == 1.0
    assert env.reward(ex, f"{a} + {b} = {a + b}. Then add {a} more.") == 0.0  # a later number decides
    assert env.reward(ex, f"{a + b + 1}") == 0.0 and env.reward(ex, "no idea") == 0.0
    assert last_integer("1,234 and -5") == "-5" and last_integer("x") is None


def test_eval_set_is_fixed():
    env = Addition(eval_size=16, eval_seed=9)
    first, second = env.eval_examples(), env.eval_examples()
    assert first is not None and second is not None and len(first) == 16
    assert [e.answer for e in first] == [e.answer for e in second]
    assert [e.answer for e in Addition(eval_size=16, eval_seed=10).eval_examples() or []] != [e.answer for e in first]


def test_bad_args_are_refused():
    with pytest.raises(ValueError, match="low <= high"):
        Addition(low=50, high=10)
    with pytest.raises(ValueError, match="eval_size"):
        Addition(eval_size=0)


def test_default_eval_set_is_256_problems_whose_first_64_are_the_old_set():
    big, old = Addition().eval_examples() or [], Addition(eval_size=64).eval_examples() or []
    assert len(big) == 256 and [e.answer for e in big[:64]] == [e.answer for e in old]
    assert len({(e.info["a"], e.info["b"]) for e in big}) > 240  # few repeats among 8,100 problems


def test_text_format_is_a_plain_continuation_scored_by_its_first_number():
    """`prompt_format: text` (a base model's task): the prompt is the string "A + B =", sent without a chat template,
    and the first integer the continuation writes is the answer (the model goes on past it)."""
    env = make_env("addition", {"low": 0, "high": 9, "prompt_format": "text"})
    ex = env.sample(random.Random(3))
    a, b = ex.info["a"], ex.info["b"]
    assert ex.prompt == f"{a} + {b} =" and ex.answer == str(a + b)
    assert env.reward(ex, f" {a + b}\n\n{a} + 7 = {a + 7}") == 1.0
    assert env.reward(ex, f" {a + b + 1}\n{a + b}") == 0.0 and env.reward(ex, " =") == 0.0
    assert all(isinstance(e.prompt, str) for e in env.eval_examples() or [])
    with pytest.raises(ValueError, match="prompt_format must be 'chat'"):
        Addition(prompt_format="plain")


def test_eval_all_is_every_problem_of_the_task_once_in_order():
    """`eval_all`: each (A, B) in [low, high] squared exactly once, A then B in order, each scored by its own sum;
    eval_size / eval_seed beside it would be ignored, so they are refused, as is a task too large to enumerate."""
    env = make_env("addition", {"low": 0, "high": 19, "prompt_format": "text", "eval_all": True})
    examples = env.eval_examples() or []
    pairs = [(e.info["a"], e.info["b"]) for e in examples]
    assert len(pairs) == 400 and len(set(pairs)) == 400 and pairs == sorted(pairs)
    assert pairs[0] == (0, 0) and pairs[-1] == (19, 19)
    assert all(e.prompt == f"{a} + {b} =" and e.answer == str(a + b) for e, (a, b) in zip(examples, pairs, strict=True))
    small = Addition(low=3, high=5, eval_all=True).eval_examples() or []
    assert [e.info["a"] for e in small] == [3] * 3 + [4] * 3 + [5] * 3
    with pytest.raises(ValueError, match="eval_all evaluates every problem"):
        Addition(low=0, high=19, eval_all=True, eval_size=128)
    with pytest.raises(ValueError, match="eval_all evaluates every problem"):
        Addition(low=0, high=19, eval_all=True, eval_seed=7)
    assert len(Addition(low=10, high=99, eval_all=True).eval_examples() or []) == 8100
    with pytest.raises(ValueError, match="10201 problems, more than 10000"):
        Addition(low=0, high=100, eval_all=True)
