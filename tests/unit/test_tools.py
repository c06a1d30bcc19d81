"""Tool schemas, tool-call parsing in three chat formats, tool sessions and TRL's environment_factory contract
(`tidal.envs.tools`), and the orch `env[].tools` config."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from tidal.config.load import ConfigError, validate
from tidal.config.orch import OrchConfig
from tidal.envs.tools import ToolCall, Tooling, parse_tool_calls, tool_schema, tooling_from_config


def add(a: int, b: int = 1) -> int:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


async def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: what to shout
    """
    return text.upper()


def boom(x: str) -> str:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError(f"no {x}")


class Counter:
    """An environment_factory environment: state per rollout, public methods are tools, get_reward scores."""

    def __init__(self) -> None:
        self.total = 0
        self.target = 0

    def reset(self, target: int = 3, **row) -> str:
        self.total, self.target = 0, target
        return f" (reach {target})"

    def increment(self, by: int) -> int:
        """Increment the counter.

        Args:
            by: how much to add
        """
        self.total += by
        return self.total

    def get_reward(self) -> float:
        return float(self.total == self.target)

    def _helper(self) -> None:  # private: not a tool
        pass


def test_schema_from_type_hints_and_docstring():
    s = tool_schema(add)
    assert s["type"] == "function" and s["function"]["name"] == "add"
    assert s["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first number"}
    assert s["function"]["parameters"]["required"] == ["a"]


def test_schema_errors_name_the_function():
    def bare(x):
        return x

    with pytest.raises(ValueError, match="tool .*bare.*type hints"):
        tool_schema(bare)


def test_schemas_load_no_torch():
    """The orchestrator builds schemas with transformers' pure-Python helper: torch stays unloaded."""
    code = ("import sys; from tidal.envs.tools import tool_schema\n"
            "def f(x: int) -> int:\n    '''F.\n\n    Args:\n        x: x\n    '''\n    return x\n"
            "tool_schema(f); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("args", ['{"a": 2, "b": 5}', '"{\\"a\\": 2, \\"b\\": 5}"'])
def test_hermes_calls_with_object_or_string_arguments(args):
    text = f'let me add<tool_call>\n{{"name": "add", "arguments": {args}}}\n</tool_call>'
    content, calls = parse_tool_calls(text, "hermes")
    assert content == "let me add"
    assert calls == [ToolCall("add", {"a": 2, "b": 5})]


def test_hermes_several_calls_and_a_malformed_one():
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": </tool_call>')
    _, calls = parse_tool_calls(text, "auto")
    assert calls[0] == ToolCall("add", {"a": 1})
    assert calls[1].error is not None and "not valid JSON" in calls[1].error


def test_mistral_calls_with_and_without_the_marker():
    text = ('ok[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, '
            '{"name": "shout", "arguments": "{\\"text\\": \\"hi\\"}"}]')
    content, calls = parse_tool_calls(text, "mistral")
    assert content == "ok" and [c.name for c in calls] == ["add", "shout"] and calls[1].arguments == {"text": "hi"}
    _, calls = parse_tool_calls('[{"name": "add", "arguments": {"a": 4}}]', "auto")  # marker dropped in decoding
    assert calls == [ToolCall("add", {"a": 4})]


def test_llama3_json_calls():
    _, calls = parse_tool_calls('<|python_tag|>{"name": "add", "parameters": {"a": 7}}', "llama3_json")
    assert calls == [ToolCall("add", {"a": 7})]
    _, calls = parse_tool_calls('{"name": "add", "parameters": {"a": 7}}', "auto")
    assert calls == [ToolCall("add", {"a": 7})]


def test_plain_answers_have_no_calls():
    for fmt in ("auto", "hermes", "mistral", "llama3_json"):
        assert parse_tool_calls("the answer is 4", fmt) == ("the answer is 4", [])
    with pytest.raises(ValueError, match="not one of"):
        parse_tool_calls("x", "xml")


def test_session_runs_sync_async_failing_and_unknown_tools():
    session = Tooling([add, shout, boom]).open({"prompt": []})
    msgs = asyncio.run(session.respond([ToolCall("add", {"a": 2}), ToolCall("shout", {"text": "hi"}),
                                        ToolCall("boom", {"x": "way"}), ToolCall("nope", {}),
                                        ToolCall("add", error="bad json")]))
    assert [m["content"] for m in msgs[:2]] == ["3", "HI"]
    assert all(m["role"] == "tool" for m in msgs) and msgs[0]["name"] == "add"
    assert json.loads(msgs[2]["content"]) == {"error": "RuntimeError: no way"}
    assert "unknown tool 'nope'" in json.loads(msgs[3]["content"])["error"]
    assert json.loads(msgs[4]["content"]) == {"error": "bad json"}
    assert session.calls == 5 and session.failures == 3


def test_environment_factory_contract():
    """One instance per rollout, reset(**row) -> observation, public methods as tools, get_reward as a reward
    function named after the class."""
    tooling = Tooling([add], environment_factory=Counter)
    assert [s["function"]["name"] for s in tooling.schemas] == ["add", "increment"]
    a, b = tooling.open({"prompt": [], "target": 2}), tooling.open({"prompt": [], "target": 2})
    assert a.environment is not b.environment and a.observation == " (reach 2)"
    asyncio.run(a.respond([ToolCall("increment", {"by": 2})]))
    asyncio.run(b.respond([ToolCall("increment", {"by": 1})]))
    name, fn, weight = tooling.reward_function()
    assert (name, weight) == ("Counter", 1.0)
    assert asyncio.run(fn(environments=[a.environment, b.environment], prompts=[])) == [1.0, 0.0]


def test_bad_tooling_is_refused():
    with pytest.raises(ValueError, match="no tool functions"):
        Tooling([])
    with pytest.raises(ValueError, match="unique"):
        Tooling([add, add])
    with pytest.raises(ValueError, match="reset"):
        Tooling(environment_factory=dict)


def test_orch_tools_config(tmp_path):
    cfg = validate(OrchConfig, {"env": [{"id": "dataset", "tools": {
        "functions": ["tests.unit.test_tools:add"], "environment_factory": "tests.unit.test_tools:Counter",
        "format": "hermes", "max_iterations": 2}}]}, "orch.yaml")
    t = cfg.env[0].tools
    assert t is not None
    tooling = tooling_from_config(t.functions, t.environment_factory, t.format, t.max_iterations)
    assert tooling.max_iterations == 2 and tooling.has_reward
    with pytest.raises(ConfigError, match="functions .* or an environment_factory"):
        validate(OrchConfig, {"env": [{"id": "dataset", "tools": {}}]}, "orch.yaml")
    with pytest.raises(ConfigError, match="format"):
        validate(OrchConfig, {"env": [{"id": "dataset", "tools": {"functions": ["a:b"], "format": "xml"}}]},
                 "orch.yaml")
    with pytest.raises(ValueError, match="cannot import"):
        tooling_from_config(["tests.unit.test_tools:nothing"], None, "auto", None)


class TemplateRenderer:
    """What `InferenceClient.tokenize_chat` asks the server for, rendered by the tokenizer's own chat template
    (vLLM's /tokenize renders with the same transformers call)."""

    def __init__(self, tok) -> None:
        self.tok = tok

    async def tokenize_chat(self, model, messages, tools=None, add_generation_prompt=True):
        ids = self.tok.apply_chat_template(messages, tools=tools, tokenize=True,
                                           add_generation_prompt=add_generation_prompt)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("stripping", [False, True])
def test_tool_suffix_is_what_the_template_renders_after_the_turn(tmp_path, stripping):
    """The tokens spliced in for tool results are exactly the template's rendering of the tool turn and the next
    generation prompt, also when the template renders earlier assistant turns differently once later messages
    follow (a reasoning template dropping `<think>` blocks: prefix comparison would fail there)."""
    from tests.e2e.tool_env import THINK_STRIPPING_TEMPLATE, TOOL_TEMPLATE, reverse, tool_model
    from tidal.orchestrator.toolloop import assistant_message, tool_suffix
    from tidal.trainer.model.load import load_tokenizer

    tok = load_tokenizer(str(tool_model(tmp_path / "m", THINK_STRIPPING_TEMPLATE if stripping else TOOL_TEMPLATE)))
    tools = Tooling([reverse]).schemas
    prompt = [{"role": "user", "content": "abc"}]
    turn = '<think>hmm</think><tool_call>{"name": "reverse", "arguments": {"text": "abc"}}</tool_call>'
    body, calls = parse_tool_calls(turn, "hermes")
    msg = assistant_message(body, calls, 0)
    results = [{"role": "tool", "name": "reverse", "content": "cba", "tool_call_id": "c00000000"}]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    suffix = asyncio.run(tool_suffix(TemplateRenderer(tok), "m", prompt + [msg], results, eos, tools))
    assert tok.decode(suffix) == "\n<|im_start|>tool\ncba<|im_end|>\n<|im_start|>assistant\n"
    # what the loop builds (prompt + sampled turn + suffix) continues exactly like the full rendering's tail
    full = tok.apply_chat_template(prompt + [msg] + results, tools=tools, tokenize=False, add_generation_prompt=True)
    assert full.endswith(tok.decode(suffix))
    if stripping:  # the earlier turn lost its <think> block: a prefix check against it would fail
        assert "<think>" not in full
