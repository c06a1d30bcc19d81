"""Multi-turn classic verifiers environments through tidal's tool loop: a `vf.ToolEnv` (its tools rendered as
schemas, the model's parsed tool calls answered by its own `env_response`, stopped by its own `no_tools_called`),
a plain `vf.MultiTurnEnv` answering with user messages until `max_turns`, rubric scoring of the rollout's messages
with its State; and `verifiers:NAME` loading of an environment package built and pip-installed into a temporary
directory here (in a subprocess that has it on its path)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

vf = pytest.importorskip("verifiers", reason="the verifiers package is part of the dev install")

from datasets import Dataset  # noqa: E402

from tidal.envs.tools import parse_tool_calls  # noqa: E402
from tidal.envs.verifiers import VerifiersEnv  # noqa: E402
from tidal.orchestrator.toolloop import assistant_message  # noqa: E402

ROWS = [{"question": f"Reverse {w}", "answer": w[::-1]} for w in ("abc", "hello", "tidal", "xyz")]


def reverse(text: str) -> str:
    """Reverse a text.

    Args:
        text: the text to reverse
    """
    return text[::-1]


def answered(completion, answer, **kwargs) -> float:
    """1 when the last assistant message is the answer (messages are verifiers' pydantic messages or dicts)."""
    last = completion[-1]
    content = last["content"] if isinstance(last, dict) else last.content
    return float(content == answer)


def tool_env(max_turns: int = 4):
    rubric = vf.Rubric(funcs=[answered], weights=[1.0])
    return vf.ToolEnv(dataset=Dataset.from_list(ROWS), tools=[reverse], max_turns=max_turns, rubric=rubric)


def turn(text: str, round_: int = 0) -> dict:
    """The assistant message the loop builds from a model turn's text."""
    body, calls = parse_tool_calls(text, "auto")
    return assistant_message(body if calls else text, calls, round_), calls


def play(env: VerifiersEnv, example, texts: list[str]) -> SimpleNamespace:
    """A rollout whose model turns are `texts`, through the session's `after_turn` as the loop calls it."""
    session = env.tooling.open({"prompt": example.prompt, **env.reward_columns(example)})
    history, out = list(example.prompt), []
    for k, text in enumerate(texts):
        msg, calls = turn(text, k)
        history.append(msg)
        out.append(msg)
        answer = asyncio.run(session.after_turn(history, calls))
        if not answer:
            break
        history += answer
        out += answer
    return SimpleNamespace(text="", messages=out, environment=session.environment, done=answer is None)


def test_tool_env_tools_calls_results_stop_and_score():
    env = VerifiersEnv(tool_env(), "rev")
    assert [s["function"]["name"] for s in env.tooling.schemas] == ["reverse"]
    assert env.tooling.schemas[0]["function"]["parameters"]["properties"]["text"]["type"] == "string"
    ex = env.sample(__import__("random").Random(0))
    word = ex.answer[::-1]
    good = play(env, ex, [f'<tool_call>{{"name": "reverse", "arguments": {{"text": "{word}"}}}}</tool_call>',
                          ex.answer, "never reached"])
    assert [m["role"] for m in good.messages] == ["assistant", "tool", "assistant"], good.messages
    assert good.messages[1]["content"] == ex.answer and good.messages[1]["name"] == "reverse"
    assert good.messages[1]["tool_call_id"] == good.messages[0]["tool_calls"][0]["id"]
    assert good.done, "ToolEnv's own stop condition (no tool called) ended the rollout"
    bad = play(env, ex, ['[{"name": "reverse", "arguments": {"text": "q"}}]', "wrong"])  # Mistral-style call
    assert bad.messages[1]["content"] == "q"
    assert env.score_rollouts(ex, [good, bad]) == [1.0, 0.0]
    assert len(good.environment["trajectory"]) == 2


def test_multi_turn_env_answers_with_user_messages_until_max_turns():
    class Nudge(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            return [{"role": "user", "content": f"again ({len(state['trajectory'])})"}]

    rubric = vf.Rubric(funcs=[answered], weights=[1.0])
    env = VerifiersEnv(Nudge(dataset=Dataset.from_list(ROWS), max_turns=3, rubric=rubric), "nudge")
    assert env.tooling.schemas == []
    ex = env.sample(__import__("random").Random(1))
    r = play(env, ex, ["one", "two", ex.answer, "four"])
    assert [m["role"] for m in r.messages] == ["assistant", "user", "assistant", "user", "assistant"]
    assert r.messages[1]["content"] == "again (1)" and r.done
    assert env.score_rollouts(ex, [r]) == [1.0]


PACKAGE = '''
import verifiers as vf
from datasets import Dataset


def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: what to shout
    """
    return text.upper()


def load_environment(n: int = 3, **kwargs):
    rows = [{"question": f"shout {i}", "answer": str(i)} for i in range(n)]
    return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[shout], max_turns=3)
'''


def test_verifiers_name_loads_an_installed_environment_package(tmp_path):
    src, site = tmp_path / "src", tmp_path / "site"
    (src / "tidal_vf_shout").mkdir(parents=True)
    (src / "tidal_vf_shout" / "__init__.py").write_text(PACKAGE)
    (src / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "tidal-vf-shout"
        version = "0.1.0"
        [tool.setuptools]
        packages = ["tidal_vf_shout"]
    """))
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                          "--no-build-isolation", "--target", str(site), str(src)],
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-3000:]
    probe = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(site)!r})
        from tidal.envs import make_env
        env = make_env("verifiers:tidal-vf-shout", {{"n": 5}})
        print(json.dumps({{"id": env.id, "rows": len(env.rows),
                          "tools": [s["function"]["name"] for s in env.tooling.schemas]}}))
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"id": "tidal-vf-shout", "rows": 5, "tools": ["shout"]}
