"""The `math` environment: generated word problems with correct answers, math-verify rewards, and user data
from local jsonl/parquet files through Hugging Face datasets."""

from __future__ import annotations

import json
import random

import pytest

from tidal.envs import make_env


def test_generated_problems_have_correct_answers_and_verify():
    env = make_env("math", {"max_operand": 9})
    rng = random.Random(0)
    for _ in range(50):
        ex = env.sample(rng)
        assert env.reward(ex, env.reference_completion(ex)) == 1.0
        assert env.reward(ex, f"\\boxed{{{int(ex.answer) + 1}}}") == 0.0
        assert env.reward(ex, "I don't know") == 0.0
    assert env.eval_examples() is None


def test_math_verify_accepts_equivalent_forms():
    env = make_env("math", {})
    from tidal.envs.base import Example

    ex = Example(prompt=[], answer="\\frac{1}{2}")
    assert env.reward(ex, "so the result is \\boxed{0.5}") == 1.0
    assert env.reward(ex, "\\boxed{1/2}") == 1.0
    assert env.reward(ex, "\\boxed{0.25}") == 0.0


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_user_data_files_load_through_datasets(tmp_path, fmt):
    rows = [{"q": f"What is {i} + {i}?", "a": str(2 * i)} for i in range(7)]
    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import datasets

        datasets.Dataset.from_list(rows).to_parquet(str(path))
    env = make_env("math", {"data_files": str(path), "question_key": "q", "answer_key": "a"})
    ex = env.sample(random.Random(1))
    assert ex.prompt[-1]["content"] in {r["q"] for r in rows}
    assert env.reward(ex, f"\\boxed{{{ex.answer}}}") == 1.0
    assert len(env.eval_examples()) == 7


def test_bad_data_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        make_env("math", {"data_files": str(tmp_path / "nope.jsonl")})
    (tmp_path / "d.jsonl").write_text('{"x": 1}\n')
    with pytest.raises(ValueError, match="no column 'question'.*question_key"):
        make_env("math", {"data_files": str(tmp_path / "d.jsonl")})


def test_an_environment_by_import_path_like_the_docs_example():
    env = make_env("examples.my_env:CountVowels", {"words": ["queue"]})
    ex = env.sample(random.Random(0))
    assert ex.answer == "4" and env.reward(ex, "It has 4") == 1.0 and env.reward(ex, "3") == 0.0
    with pytest.raises(ValueError, match="cannot import"):
        make_env("examples.nothing_here:X", {})
    with pytest.raises(ValueError, match="not a tidal Environment"):
        make_env("random:Random", {})


def test_math_reward_works_off_the_main_thread():
    """Rewards run in worker threads (reward_timeout_s, env servers); math-verify's SIGALRM timeouts must not
    turn every answer into 0 there."""
    import threading

    env = make_env("math", {})
    ex = env.sample(random.Random(3))
    out: list[float] = []
    t = threading.Thread(target=lambda: out.append(env.reward(ex, env.reference_completion(ex))))
    t.start()
    t.join(30)
    assert out == [1.0]
