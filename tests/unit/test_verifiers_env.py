"""The verifiers adapter: a classic verifiers environment (SingleTurnEnv + Rubric + Parser), built here from an
in-memory dataset, sampled and scored through tidal's Environment API, by object, factory path and registry."""

from __future__ import annotations

import asyncio
import random

import pytest

vf = pytest.importorskip("verifiers", reason="the verifiers package is part of the dev install")

from datasets import Dataset  # noqa: E402

from tidal.envs import make_env  # noqa: E402
from tidal.envs.verifiers import VerifiersEnv  # noqa: E402

ROWS = [{"question": f"What is {a} + {b}?", "answer": str(a + b), "difficulty": a % 3} for a in range(7)
        for b in range(5)]


def correct(completion, answer, parser, **kwargs) -> float:
    return 1.0 if parser.parse_answer(completion) == answer else 0.0


def uses_column(completion, difficulty, **kwargs) -> float:
    """A reward reading a dataset column by name."""
    return float(difficulty)


def shortest_in_group(completions, **kwargs) -> list[float]:
    """A group-level reward: 1 for the group's shortest completion(s)."""
    lengths = [len(c[-1]["content"] if isinstance(c[-1], dict) else c[-1].content) for c in completions]
    return [1.0 if n == min(lengths) else 0.0 for n in lengths]


def build(n_eval: int = 4):
    parser = vf.XMLParser(["answer"], answer_field="answer")
    rubric = vf.Rubric(funcs=[correct, uses_column, shortest_in_group], weights=[1.0, 0.25, 0.5], parser=parser)
    return vf.SingleTurnEnv(dataset=Dataset.from_list(ROWS), eval_dataset=Dataset.from_list(ROWS[:n_eval]),
                            system_prompt="Answer inside <answer></answer>.", parser=parser, rubric=rubric)


def test_examples_come_from_the_dataset_with_the_system_prompt():
    env = VerifiersEnv(build(), "sums")
    rng = random.Random(0)
    seen = set()
    for _ in range(200):
        ex = env.sample(rng)
        assert ex.prompt[0] == {"role": "system", "content": "Answer inside <answer></answer>."}
        q = ex.prompt[1]["content"]
        a, b = (int(x) for x in q.removeprefix("What is ").removesuffix("?").split(" + "))
        assert ex.answer == str(a + b)
        seen.add(q)
    assert len(seen) > 25, "sampling covers the dataset"
    assert [e.prompt[1]["content"] for e in env.eval_examples()] == [r["question"] for r in ROWS[:4]]


def test_group_scores_follow_the_rubric_weights_parser_columns_and_group_functions():
    env = VerifiersEnv(build(), "sums")
    rng = random.Random(1)
    for _ in range(10):
        ex = env.sample(rng)
        difficulty = ex.info["verifiers_row"]["difficulty"]
        good, wrong = f"<answer>{ex.answer}</answer>", "<answer>-1</answer> because I think so"
        comps = [good, wrong, f"thinking... {good}"]
        got = env.reward_group(ex, comps)
        want = [1.0 + 0.25 * difficulty + 0.5, 0.0 + 0.25 * difficulty, 1.0 + 0.25 * difficulty]
        assert got == pytest.approx(want), (comps, got, want)
    # the per-completion API gives the same as a group of one
    assert env.reward(ex, good) == pytest.approx(1.0 + 0.25 * difficulty + 0.5)


def test_scoring_also_works_inside_a_running_event_loop():
    env = VerifiersEnv(build(), "sums")
    ex = env.sample(random.Random(2))

    async def inside() -> list[float]:
        return env.reward_group(ex, [f"<answer>{ex.answer}</answer>"])

    assert asyncio.run(inside())[0] >= 1.0


def test_by_factory_import_path_and_by_object(monkeypatch):
    env = make_env("tests.unit.test_verifiers_env:build", {"n_eval": 2})
    assert isinstance(env, VerifiersEnv) and len(env.eval_examples()) == 2
    import sys

    monkeypatch.setattr(sys.modules[__name__], "ENV_OBJECT", build(), raising=False)
    assert isinstance(make_env("tests.unit.test_verifiers_env:ENV_OBJECT"), VerifiersEnv)
    with pytest.raises(ValueError, match="takes no args"):
        make_env("tests.unit.test_verifiers_env:ENV_OBJECT", {"x": 1})


def test_multi_turn_verifiers_environments_run_the_chat_format_loop():
    """(tests/unit/test_verifiers_multiturn.py runs them); single-turn ones have no session."""
    class Chatty(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            return [{"role": "user", "content": "more"}]

    assert VerifiersEnv(Chatty(dataset=Dataset.from_list(ROWS), max_turns=3)).tooling is not None
    assert VerifiersEnv(build()).tooling is None


def test_unknown_installed_environment_is_a_clear_error():
    with pytest.raises(ValueError, match="no-such-env.*installed"):
        make_env("verifiers:no-such-env", {})
