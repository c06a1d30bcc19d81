"""A verifiers 0.4 taskset for the e2e run (tests/e2e/test_verifiers04_run.py): reverse-text prompts, a `Toolset`
with a `reverse` tool, rewards over the rollout's tool messages. Built inside the factory because the venv has the
classic verifiers; the run puts 0.4 first on PYTHONPATH."""

from __future__ import annotations

import random
from typing import Any

from tidal.envs.reverse_text import SYSTEM_PROMPT, ReverseText


def build_tool_taskset(n: int = 64, seed: int = 0) -> Any:
    import verifiers.v1 as vf

    class Reverser(vf.Toolset):
        @vf.tool
        async def reverse(self, text: str) -> str:
            """Reverse a text."""
            return text[::-1]

    class ReverseData(vf.TaskData):
        answer: str

    class ReverseTask(vf.Task[ReverseData]):
        @classmethod
        def toolsets(cls, config: Any) -> list[Any]:
            return [Reverser(vf.ToolsetConfig())]

        @vf.reward
        async def tool_results(self, trace: vf.Trace) -> float:
            return float(len(trace.tool_messages))

    class ReverseTaskset(vf.Taskset[ReverseTask]):
        def load(self) -> Any:
            rng, gen = random.Random(seed), ReverseText(4, 12)
            for _ in range(n):
                text = gen.random_text(rng)
                yield ReverseTask(ReverseData(prompt=text, system_prompt=SYSTEM_PROMPT, answer=text[::-1]))

    return ReverseTaskset(vf.TasksetConfig())
