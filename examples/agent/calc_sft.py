"""Reference transcripts of the calculator agent (examples/agent/calc_agent.py) for a `tidal sft` warm start.

SmolLM2-135M-Instruct does not call the `add` tool when told about it (bench/agent_tool_probe.py: 0 calls in 128
samples for each of four prompts, with the tool block, the program's own instructions, a one-shot demonstration),
so GRPO through the agent endpoint has no multi-turn signal from the base model. This environment gives `tidal sft`
the two model turns of the agent's conversation, rendered exactly as the endpoint renders them with agent args
`tool_prompt: system` (`tidal.envs.agent.toolprompt.with_tools_in_system`: the program's system prompt, then the
tool block): the first turn's reference is the call `<tool_call>{"name": "add", ...}</tool_call>`; the second turn's
(after the tool's result as a `<tool_response>` user turn) is the sum. `answer_share` of the examples are second
turns. Reward (unused by SFT): the addition task's.

    tidal sft --train.model tidal:smollm2-135m-instruct --train.lora false \
        --sft.env examples.agent.calc_sft:CalcToolTranscripts --sft.env_args '{low: 100, high: 999}' ...
(from the repository root, with it on PYTHONPATH; bench/agent_learn.py --sft runs it).
"""

from __future__ import annotations

import json
import random

from examples.agent.calc_agent import SYSTEM, TOOLS

from tidal.envs.addition import Addition
from tidal.envs.agent.toolprompt import with_tools_in_system
from tidal.envs.base import Example


def call_message(a: int, b: int) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {
        "name": "add", "arguments": json.dumps({"a": a, "b": b})}}]}


class CalcToolTranscripts(Addition):
    """The calculator agent's model turns on `addition` problems (module doc)."""

    id = "calc-tool-transcripts"

    def __init__(self, low: int = 100, high: int = 999, answer_share: float = 0.5, **kwargs: object) -> None:
        super().__init__(low=low, high=high, **kwargs)  # type: ignore[arg-type]
        self.answer_share = answer_share

    def sample(self, rng: random.Random) -> Example:
        ex = super().sample(rng)
        a, b = ex.info["a"], ex.info["b"]
        messages = [{"role": "system", "content": SYSTEM}, *ex.prompt]
        second = rng.random() < self.answer_share
        if second:
            messages += [call_message(a, b), {"role": "tool", "tool_call_id": "call_0", "content": str(a + b)}]
        reference = str(a + b) if second else with_tools_in_system([call_message(a, b)], None)[0]["content"]
        return Example(prompt=with_tools_in_system(messages, TOOLS), answer=ex.answer,
                       info={**ex.info, "reference": reference})

    def reference_completion(self, example: Example) -> str:
        return str(example.info["reference"])
