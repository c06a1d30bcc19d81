"""The calculator tool environment: a safe arithmetic evaluator, tool replies per turn, final-answer reward."""

from __future__ import annotations

import random

import pytest

from tidal.envs import make_env
from tidal.envs.calculator import calculate


@pytest.mark.parametrize("expr,want", [("2 + 3 * 4", "14"), ("(7 - 2) ** 2", "25"), ("7 / 2", "3.5"),
                                       ("-3 * -3", "9"), ("1 / 0", "error"), ("__import__('os')", "error"),
                                       ("2 ** 1000", "error"), ("open('x')", "error"), ("3 +", "error")])
def test_calculator_evaluates_arithmetic_only(expr, want):
    assert calculate(expr) == want


def test_tool_replies_and_reward():
    env = make_env("calculator", {"max_operand": 50})
    ex = env.sample(random.Random(2))
    assert env.max_turns == 3 and env.stop == ["</calc>"]
    expr = ex.info["expression"]
    turn1 = f"Let me compute. <calc>{expr}</calc>"
    reply = env.respond(ex, turn1)
    assert reply == f"<result>{ex.answer}</result>"
    transcript = turn1 + reply + f" So it is \\boxed{{{ex.answer}}}."
    assert env.respond(ex, transcript) is None  # answered: the rollout ends
    assert env.reward(ex, transcript) == 1.0
    assert env.reward(ex, turn1 + reply + " \\boxed{0}") == 0.0
    # the tool's own output does not count as the model's answer
    assert env.reward(ex, f"<calc>{expr}</calc><result>{ex.answer}</result> no idea") == 0.0
    assert env.respond(ex, "no tool call here") is None
