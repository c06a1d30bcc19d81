"""Tools on a chat template that ignores them (`AgentArgs.tool_prompt`, `tidal.envs.agent.toolprompt`), with real
tokenizers and real templates: the bundled model's tokenizer carrying SmolLM2-135M-Instruct's template (verbatim:
it renders only role and content, so `tools=` is dropped), the bundled model's own template (likewise) and
`tests.e2e.tool_env.TOOL_TEMPLATE` (renders tools). Renderings are transformers' `apply_chat_template`, which is what
vLLM's `/tokenize` runs; the only stand-in is the sampler (fixed token ids, as in the stitching tests).

- the check tells the templates apart (the two that ignore tools, the one that renders them);
- `template` (default): a call with tools on an ignoring template is answered 400 over real HTTP (real `openai` SDK)
  naming the model and the ways out, before anything is sampled; a call without tools is not refused;
- `system`: the prompt carries the Hermes tool block in the system message; a 3-call session extends one row whose
  ids equal the single-pass rendering of the rewritten conversation (the template allows it) and the splice rule's
  prompt; the SDK gets the call as `tool_calls`;
- `program`: the template renders what it renders (no refusal, no tool block);
- the config refuses `system` with a non-Hermes `tool_format`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tidal.envs.agent.server import AgentServer
from tidal.envs.agent.session import Session
from tidal.envs.agent.toolprompt import SystemToolsBackend, tools_ignored, with_tools_in_system
from tidal.envs.splice import splice_after
from tidal.inference.protocol import Completion

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
QUESTION = [{"role": "user", "content": "What is 3 + 4?"}]


def tokenizer(template: str | None) -> Any:
    """The bundled model's tokenizer, with `template` as its chat template (None: its own)."""
    from transformers import AutoTokenizer

    from tidal.models.sources import bundled

    tok = AutoTokenizer.from_pretrained(str(bundled("tidal:tiny-reverse")))
    if template is not None:
        tok.chat_template = template
    return tok


class TemplateBackend:
    """A session backend rendering with a real tokenizer's chat template (as vLLM's /tokenize does) and sampling
    fixed answers: each call's tokens are the next text of `answers` tokenized, plus `<|im_end|>`."""

    def __init__(self, tok: Any, answers: list[str] | None = None) -> None:
        self.tok, self.answers, self.model = tok, list(answers or []), "smollm2-like"
        self.prompts: list[list[int]] = []
        self.end = tok.convert_tokens_to_ids("<|im_end|>")

    def ids(self, messages: list[dict[str, Any]], tools: Any, gen: bool) -> list[int]:
        out = self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    async def render(self, messages: list[dict[str, Any]], tools: Any) -> list[int]:
        return self.ids(messages, tools, True)

    async def suffix(self, history: list[dict[str, Any]], new: list[dict[str, Any]], stop_id: int,
                     tools: Any) -> list[int]:
        return splice_after(self.ids(history, tools, False), self.ids(history + new, tools, True), stop_id)

    async def sample(self, prompt_ids: list[int], max_tokens: int, call: int, params: dict[str, Any],
                     on_text: Any = None) -> Completion:
        self.prompts.append(list(prompt_ids))
        text = self.answers.pop(0)
        ids = [*self.tok.encode(text, add_special_tokens=False), self.end]
        return Completion(ids, [-0.5] * len(ids), text + "<|im_end|>", "stop", [*([""] * (len(ids) - 1)),
                                                                               "<|im_end|>"])

    def on_policy(self, params: dict[str, Any]) -> bool:
        return True


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_the_check_tells_templates_that_ignore_tools_from_one_that_renders_them():
    from tests.e2e.tool_env import TOOL_TEMPLATE

    for template, ignored in [(SMOLLM2_TEMPLATE, True), (None, True), (TOOL_TEMPLATE, False)]:
        backend = TemplateBackend(tokenizer(template))
        assert run(tools_ignored(backend, QUESTION, TOOLS)) is ignored, template


def serve(backend: Any, probe: Any, tool_prompt: str) -> tuple[Session, Any]:
    """One session on a real endpoint with `backend`; `probe(openai_url, key)` runs in a thread."""
    async def go() -> tuple[Session, Any]:
        server = AgentServer("policy", "auto", 4, tool_prompt=tool_prompt)
        session = Session("s1", {}, 8, None, 1024)
        await server.ensure_started()
        server.open(session, backend)
        try:
            return session, await asyncio.to_thread(probe, server.urls(session)[0], session.key)
        finally:
            await server.stop()

    return asyncio.run(go())


def test_tools_on_an_ignoring_template_are_refused_naming_the_model_and_the_way_out():
    import openai

    backend = TemplateBackend(tokenizer(SMOLLM2_TEMPLATE), ["7"])

    def probe(url: str, key: str) -> tuple[str, str]:
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS)  # type: ignore[arg-type]
        plain = client.chat.completions.create(model="policy", messages=QUESTION)  # type: ignore[arg-type]
        return str(err.value), plain.choices[0].message.content or ""

    session, (refusal, plain) = serve(backend, probe, "template")
    assert "ignores `tools`" in refusal and "smollm2-like" in refusal
    assert "tool_prompt: system" in refusal and "tool_prompt: program" in refusal
    assert plain == "7" and len(backend.prompts) == 1, "only the call without tools was sampled"
    assert session.calls == 1


def test_system_tool_prompt_renders_the_tools_and_extends_one_row_over_three_calls():
    import openai

    tok = tokenizer(SMOLLM2_TEMPLATE)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    backend = TemplateBackend(tok, [call, call, "3 + 4 = 7"])

    def probe(url: str, key: str) -> list[Any]:
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
        messages: list[Any] = [{"role": "system", "content": "Use the calculator."}, *QUESTION]
        answers = []
        for _ in range(3):
            msg = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
            answers.append(msg)
            messages.append(msg)
            for c in msg.tool_calls or []:
                args = json.loads(c.function.arguments)  # type: ignore[union-attr]
                messages.append({"role": "tool", "tool_call_id": c.id, "content": str(args["a"] + args["b"])})
        return answers

    session, answers = serve(backend, probe, "system")
    assert [bool(a.tool_calls) for a in answers] == [True, True, False]
    assert answers[0].tool_calls[0].function.name == "add" and answers[2].content == "3 + 4 = 7"
    first = tok.decode(backend.prompts[0])
    assert first.startswith("<|im_start|>system\nUse the calculator.\n\n# Tools") and '"name": "add"' in first
    assert "SmolLM" not in first, "the tool block's system message replaces the template's default one"
    assert session.forks == 0 and len(session.rows) == 1 and session.calls == 3
    row = session.rows[0]
    # the single-pass rendering of the whole rewritten conversation (this template renders earlier turns unchanged)
    whole = [{"role": "system", "content": "Use the calculator."}, *QUESTION]
    for c in [call, call]:
        whole += [{"role": "assistant", "content": c},
                  {"role": "user", "content": "<tool_response>\n7\n</tool_response>"}]
    rendered = backend.ids(with_tools_in_system(whole, TOOLS), None, True)
    assert backend.prompts[2] == rendered
    assert row.prompt_ids + row.ids[:len(rendered) - len(row.prompt_ids)] == rendered
    assert backend.prompts[1] == backend.prompts[0] + row.ids[:len(backend.prompts[1]) - len(backend.prompts[0])]
    sampled = sum(row.mask)
    assert sampled == sum(len(tok.encode(t, add_special_tokens=False)) + 1 for t in [call, call, "3 + 4 = 7"])


def test_the_system_rewrite_and_suffix_by_hand():
    calls = [{"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]
    history = [*QUESTION, {"role": "assistant", "content": "Let me add.", "tool_calls": calls}]
    new = [{"role": "tool", "tool_call_id": "c", "content": "3"}, {"role": "tool", "tool_call_id": "d", "content": "x"}]
    out = with_tools_in_system(history + new, TOOLS)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("# Tools") and "</tools>" in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": 'Let me add.\n<tool_call>\n{"name": "add", "arguments": '
                                                      '{"a": 1, "b": 2}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>\n<tool_response>\nx\n"
                                                 "</tool_response>"}
    assert len(out) == 4
    tok = tokenizer(SMOLLM2_TEMPLATE)
    inner = TemplateBackend(tok)
    end = inner.end
    got = run(SystemToolsBackend(inner).suffix(history, new, end, TOOLS))
    assert tok.decode(got) == ("\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\nx\n"
                               "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_program_tool_prompt_renders_what_the_template_renders():
    import openai

    tok = tokenizer(SMOLLM2_TEMPLATE)
    backend = TemplateBackend(tok, ["7"])

    def probe(url: str, key: str) -> str:
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
        msg = client.chat.completions.create(model="policy", messages=QUESTION, tools=TOOLS)  # type: ignore[arg-type]
        return msg.choices[0].message.content or ""

    _, answer = serve(backend, probe, "program")
    assert answer == "7" and backend.prompts[0] == backend.ids(QUESTION, None, True)


def test_system_tool_prompt_needs_hermes_calls(tmp_path: Path):
    from tidal.config.environments import EnvSection

    with pytest.raises(ValueError, match="tool_format"):
        EnvSection(id="agent", args={"command": "x", "task": {"id": "reverse-text"}, "tool_prompt": "system",
                                     "tool_format": "mistral"})
    with pytest.raises(ValueError, match="tool_prompt"):
        EnvSection(id="agent", args={"command": "x", "task": {"id": "reverse-text"}, "tool_prompt": "prompt"})


def test_the_warm_start_transcripts_are_what_the_endpoint_renders_for_the_calculator_agent():
    """examples/agent/calc_sft.py (the SmolLM2 bench's `tidal sft` data) renders both model turns exactly as the
    endpoint does for examples/agent/calc_agent.py under `tool_prompt: system`; its references are the turns."""
    import random

    from examples.agent.calc_agent import main
    from examples.agent.calc_sft import CalcToolTranscripts

    from tidal.trainer.sft import render_prompt

    tok = tokenizer(SMOLLM2_TEMPLATE)
    env = CalcToolTranscripts(low=100, high=999, answer_share=0.5)
    turns = {}
    for seed in range(40):
        ex = env.sample(random.Random(seed))
        turns.setdefault(ex.info["reference"] == ex.answer, (ex, env.reference_completion(ex)))
    (call_ex, call), (answer_ex, answer) = turns[False], turns[True]
    assert answer_ex.info["reference"] == answer == answer_ex.answer
    a, b = call_ex.info["a"], call_ex.info["b"]
    backend = TemplateBackend(tok, [call, str(a + b)])
    example = {"prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with a number."}]}

    def probe(url: str, key: str) -> None:
        main(url, key, example)

    session, _ = serve(backend, probe, "system")
    assert session.calls == 2 and session.forks == 0, "the program called the tool and sent its result back"
    assert backend.prompts[0] == render_prompt(tok, call_ex.prompt)
    expected = [*call_ex.prompt, {"role": "assistant", "content": call},  # the answer turn's shape in calc_sft
                {"role": "user", "content": f"<tool_response>\n{a + b}\n</tool_response>"}]
    assert backend.prompts[1] == render_prompt(tok, expected)
    assert answer_ex.prompt[-2]["content"].startswith("<tool_call>\n")
