"""A tool-calling test environment the bundled model can learn, and a Hermes-style chat template that renders tools.

`ReverseTool`: the user message is a short lowercase string; the model may call the tool `reverse(text)` in the
Hermes/Qwen format (`<tool_call>{"name": "reverse", "arguments": {"text": ...}}</tool_call>`). Reward: 0 without a
parsed call to `reverse`, else 0.5 + 0.5 x the similarity of its `text` argument to the user's string. Its reference
completion (for `tidal sft`) is that call. `TOOL_TEMPLATE` is the chat template the tests put on a copy of the
bundled model (whose own template knows no tools); `THINK_STRIPPING_TEMPLATE` also drops `<think>...</think>` from
assistant turns that are not the last message, as reasoning models' templates do.
"""

from __future__ import annotations

import random
import shutil
import string
from pathlib import Path

from tidal.envs.base import Environment, Example
from tidal.envs.reverse_text import ReverseText, similarity
from tidal.envs.tools import Tooling, parse_tool_calls

_HEAD = """{%- if tools %}<|im_start|>system
{% for t in tools %}{{ t.function.name }}: {{ t.function.description }}
{% endfor %}<|im_end|>
{% endif %}{%- for message in messages %}{%- if message.role == 'assistant' %}<|im_start|>assistant
"""
_CONTENT = "{{ message.content }}"
_STRIPPED = ("{% if loop.last %}{{ message.content }}{% else %}"
             "{{ message.content.split('</think>')[-1] }}{% endif %}")
_TAIL = """{% for c in message.tool_calls or [] %}<tool_call>{"name": "{{ c.function.name }}", \
"arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>tool
{{ message.content }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
TOOL_TEMPLATE = _HEAD + _CONTENT + _TAIL
THINK_STRIPPING_TEMPLATE = _HEAD + _STRIPPED + _TAIL


def tool_model(dst: Path, template: str = TOOL_TEMPLATE) -> Path:
    """A copy of the bundled model at `dst` with `template` as its chat template."""
    from tidal.models.sources import bundled

    shutil.copytree(bundled("tidal:tiny-reverse"), dst)
    (dst / "chat_template.jinja").write_text(template)
    return dst


def tagged_tool_model(dst: Path) -> Path:
    """A copy of the bundled model that writes tool calls without training: its `<reversed_text>` tags are renamed
    `<tool_call>` (same token ids, so it writes `<tool_call>REVERSED</tool_call>`, a call that does not parse), and
    its template (`TOOL_TEMPLATE` minus the tool list, so prompts stay as it was trained on) renders tool turns."""
    import json

    tool_model(dst, TOOL_TEMPLATE.replace(_HEAD.split("{%- for message")[0], ""))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        text = (dst / name).read_text()
        (dst / name).write_text(text.replace("reversed_text>", "tool_call>"))  # <...> and </...>
    json.loads((dst / "tokenizer.json").read_text())
    return dst


def reverse(text: str) -> str:
    """Reverse a text.

    Args:
        text: the text to reverse
    """
    return text[::-1]


def call_text(completion: str) -> str | None:
    """The `text` argument of the first `reverse` call in a completion, or None."""
    _, calls = parse_tool_calls(completion, "hermes")
    for c in calls:
        if c.error is None and c.name == "reverse" and isinstance(c.arguments.get("text"), str):
            return str(c.arguments["text"])
    return None


class ReverseTool(Environment):
    """Short random strings to reverse with the `reverse` tool."""

    id = "reverse-tool"

    def __init__(self, min_len: int = 3, max_len: int = 6, max_iterations: int = 1) -> None:
        self.min_len, self.max_len = min_len, max_len
        self.tooling = Tooling([reverse], fmt="hermes", max_iterations=max_iterations)

    def sample(self, rng: random.Random) -> Example:
        text = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(self.min_len, self.max_len)))
        return Example(prompt=[{"role": "user", "content": text}], answer=text[::-1], info={"text": text})

    def reward(self, example: Example, completion: str) -> float:
        arg = call_text(completion)
        return 0.0 if arg is None else 0.5 + 0.5 * similarity(arg, example.info["text"])

    def reference_completion(self, example: Example) -> str:
        return f'<tool_call>{{"name": "reverse", "arguments": {{"text": "{example.info["text"]}"}}}}</tool_call>'


class TaggedReverse(ReverseTool):
    """reverse-text's prompts (system prompt and string) with the `reverse` tool, for `tagged_tool_model`: every
    call it writes fails to parse, the error comes back as a tool turn and the model goes on (one round)."""

    id = "tagged-reverse"

    def sample(self, rng: random.Random) -> Example:
        ex = ReverseText(4, 12).sample(rng)
        return Example(prompt=ex.prompt, answer=ex.answer, info={"text": ex.info["text"]})

    def reward(self, example: Example, completion: str) -> float:
        body = completion.partition("<tool_call>")[2].partition("</tool_call>")[0]
        return similarity(body, example.answer)
