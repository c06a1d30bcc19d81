"""A multi-turn test environment the bundled model really exercises: its first turn ends at the opening
`<reversed_text>` tag it always writes (`stop`), the environment answers with a tool-style message, and the
model continues. Used by tests/e2e/test_multiturn_run.py through `env[].id: tests.e2e.multiturn_env:EchoTool`."""

from __future__ import annotations

from tidal.envs.base import Example
from tidal.envs.reverse_text import OPEN, ReverseText

REPLY = " [tool: go on] "


class EchoTool(ReverseText):
    id = "echo-tool"
    max_turns = 2
    stop = [OPEN]  # noqa: RUF012

    def respond(self, example: Example, transcript: str) -> str | None:
        return REPLY if transcript.endswith(OPEN) and REPLY not in transcript else None

    def reward(self, example: Example, completion: str) -> float:
        return super().reward(example, completion.replace(REPLY, ""))
