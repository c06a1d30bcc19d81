"""calculator: a multi-turn tool environment — arithmetic problems the model may solve by calling a calculator.

The model calls the tool by writing `<calc>EXPRESSION</calc>`; its turn ends there (`stop`), and the
environment replies `<result>VALUE</result>` (or `<result>error</result>`), which is appended as tokens that
get no loss; the model continues, for up to `max_turns` turns. The final answer goes in `\\boxed{}` and is
checked with math-verify against the exact value. The calculator evaluates only numbers, + - * / // % ** and
parentheses, through Python's `ast` (no `eval`), with bounded exponents.
"""

from __future__ import annotations

import ast
import operator
import random
import re

from tidal.envs.base import Environment, Example
from tidal.envs.math import check

SYSTEM_PROMPT = ("Solve the problem. You may use a calculator by writing <calc>EXPRESSION</calc>; its result "
                 "comes back as <result>VALUE</result>. Put only the final answer inside \\boxed{}.")
CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, or 'error'."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return OPS[type(node.op)](left, right)
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    try:
        value = ev(ast.parse(expression.strip(), mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError):
        return "error"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


class Calculator(Environment):
    id = "calculator"
    stop = ["</calc>"]  # noqa: RUF012

    def __init__(self, max_operand: int = 999, max_turns: int = 3) -> None:
        if max_turns < 1 or max_operand < 2:
            raise ValueError(f"calculator: need max_turns >= 1 and max_operand >= 2, got {max_turns}, {max_operand}")
        self.max_operand, self.max_turns = max_operand, max_turns

    def sample(self, rng: random.Random) -> Example:
        a, b, c = (rng.randint(2, self.max_operand) for _ in range(3))
        expr = rng.choice([f"{a} * {b} + {c}", f"({a} + {b}) * {c}", f"{a} * {b} - {c}"])
        return Example(prompt=[{"role": "system", "content": SYSTEM_PROMPT},
                               {"role": "user", "content": f"What is {expr}?"}],
                       answer=calculate(expr), info={"expression": expr})

    def respond(self, example: Example, transcript: str) -> str | None:
        last_turn = transcript.rsplit("</result>", 1)[-1]
        calls = CALL.findall(last_turn)
        if not calls or "\\boxed{" in last_turn:
            return None
        return f"<result>{calculate(calls[-1])}</result>"

    def reward(self, example: Example, completion: str) -> float:
        final = completion.rsplit("</result>", 1)[-1]
        return check(example.answer, final)

    def reference_completion(self, example: Example) -> str:
        return f"<calc>{example.info['expression']}</calc>"
