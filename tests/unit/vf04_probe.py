"""Run by tests/unit/test_verifiers04.py in a subprocess whose path has verifiers 0.4 first (the venv keeps the
classic API) and the two taskset packages that test built and installed: loads them through tidal's
`verifiers:NAME`, scores completions and plays tool rollouts through the session the tool loop drives, checks the
refusals, and prints one JSON object of what it saw."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from types import SimpleNamespace
from typing import Any

import verifiers
import verifiers.v1 as vf

from tidal.envs import make_env
from tidal.envs.tools import parse_tool_calls
from tidal.envs.verifiers import VerifiersV1Env
from tidal.envs.verifiers.v1_trace import Unsupported
from tidal.orchestrator.toolloop import assistant_message


def play(env: Any, example: Any, texts: list[str]) -> SimpleNamespace:
    """A rollout whose model turns are `texts`, through the session's `after_turn` as the tool loop calls it."""
    session = env.tooling.open({"prompt": example.prompt, **env.reward_columns(example)})
    history, out, answer = list(example.prompt), [], None
    for k, text in enumerate(texts):
        body, calls = parse_tool_calls(text, "auto")
        msg = assistant_message(body if calls else text, calls, k)
        history.append(msg)
        out.append(msg)
        answer = asyncio.run(session.after_turn(history, calls))
        if not answer:
            break
        ids = iter(tc["id"] for tc in msg.get("tool_calls", []))
        answer = [{**r, "tool_call_id": next(ids, "")} for r in answer]
        history += answer
        out += answer
    return SimpleNamespace(text="", messages=out, environment=session.environment, finish_reason="stop",
                           done=answer is None, turns=session.turns)


def refusal(fn: Any) -> str:
    try:
        fn()
    except (Unsupported, ValueError) as exc:
        return str(exc)
    return "no error"


class NeedsRuntime(vf.Task[vf.TaskData]):
    @vf.reward
    async def ran(self, trace: vf.Trace, runtime: vf.Runtime) -> float:
        return 1.0


class RuntimeTasks(vf.Taskset[NeedsRuntime]):
    def load(self):
        yield NeedsRuntime(vf.TaskData(prompt="hi"))


class Intercepting(vf.Task[vf.TaskData]):
    @vf.intercept
    async def rewrite(self, request: vf.Request) -> None:
        return None


class InterceptTasks(vf.Taskset[Intercepting]):
    def load(self):
        yield Intercepting(vf.TaskData(prompt="hi"))


class Forever(vf.Taskset[vf.Task]):
    INFINITE = True

    def load(self):
        while True:
            yield vf.Task(vf.TaskData(prompt="hi"))


def main() -> None:
    out: dict[str, Any] = {"version": verifiers.__version__}
    echo = make_env("verifiers:tidal-vf4-echo", {"n": 4})
    out["echo_type"] = type(echo).__name__
    ex = echo.sample(random.Random(0))
    out["echo_prompt"] = ex.prompt
    out["echo_answer"] = ex.answer
    out["echo_scores"] = echo.reward_group(ex, [f"the answer is {ex.answer}", "no idea", f"{ex.answer}"])
    out["echo_rollout_scores"] = echo.score_rollouts(ex, [
        SimpleNamespace(text=ex.answer, messages=None, environment=None, finish_reason=finish)
        for finish in ("stop", "length")])
    out["echo_tooling"] = echo.tooling is None

    tools = make_env("verifiers:tidal-vf4-tools", {"words": ["abc", "tidal"], "agent": {"max_turns": 3}})
    out["tool_names"] = [s["function"]["name"] for s in tools.tooling.schemas]
    out["tool_params"] = tools.tooling.schemas[1]["function"]["parameters"]
    ex = tools.sample(random.Random(0))
    word = ex.answer[::-1]
    good = play(tools, ex, [f'<tool_call>{{"name": "rev_reverse", "arguments": {{"text": "{word}"}}}}</tool_call>',
                            ex.answer, "never reached"])
    bad = play(tools, ex, ['[{"name": "rev_reverse", "arguments": {"text": "q"}}]', "wrong"])
    capped = play(tools, ex, ['<tool_call>{"name": "rev_reverse", "arguments": {"text": "a"}}</tool_call>'] * 5)
    stopped = play(tools, ex, ['<tool_call>{"name": "rev_reverse", "arguments": {"text": "STOP"}}</tool_call>',
                               "after the stop"])
    unknown = play(tools, ex, ['<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "x"])
    hinted = play(tools, ex, ['<tool_call>{"name": "rev_hint", "arguments": {}}</tool_call>', "x"])
    out["hint"], out["tool_answer"] = hinted.messages[1]["content"], ex.answer
    out["good_roles"] = [m["role"] for m in good.messages]
    out["good_tool"] = good.messages[1]
    out["good_call_id"] = good.messages[0]["tool_calls"][0]["id"]
    out["good_state_calls"] = good.environment.state.calls
    out["bad_tool"] = bad.messages[1]["content"]
    out["capped_turns"] = capped.turns
    out["stopped_roles"] = [m["role"] for m in stopped.messages]
    out["unknown_tool"] = unknown.messages[1]["content"]
    out["tool_scores"] = tools.score_rollouts(ex, [good, bad, capped])

    out["refuse_runtime"] = refusal(lambda: VerifiersV1Env(RuntimeTasks(vf.TasksetConfig()), "rt"))
    out["refuse_intercept"] = refusal(lambda: VerifiersV1Env(InterceptTasks(vf.TasksetConfig()), "ic"))
    out["refuse_infinite"] = refusal(lambda: VerifiersV1Env(Forever(vf.TasksetConfig()), "inf"))
    out["refuse_agent"] = refusal(lambda: make_env("verifiers:tidal-vf4-echo", {"agent": {"harness": "bash"}}))
    out["refuse_args"] = refusal(lambda: make_env("verifiers:tidal-vf4-echo", {"bogus": 1}))
    out["refuse_missing"] = refusal(lambda: make_env("verifiers:tidal-vf4-nothing"))
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    sys.exit(main())
