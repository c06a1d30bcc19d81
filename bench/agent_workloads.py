"""The multi-turn workloads of bench/agent_overhead.py: one conversation, two ways to run it.

A workload is a model, a task environment (examples and the reward), the user's agent program (a plain `openai`-SDK
script, run by the endpoint as a function and as a command) and its in-process twin for the tool loop: the same
prompt messages and the same tool (Hermes format, 2 tool rounds at most, so at most 3 model turns, as the program's
own loop). Given the same sampled tokens, both sides then hold the same conversation token for token.

- `calc`: SmolLM2-135M-Instruct (`tidal:smollm2-135m-instruct`, or `--model`, e.g. a warm-started copy) and
  examples/agent/calc_agent.py: "What is A + B + C?", the program's system prompt and its `add(a, b)` tool. With
  `--shots`, the example's prompt opens with one worked conversation (a question, two `add` calls and their
  results, the answer), so that the model, which otherwise never calls the tool, imitates it: two tool rounds and
  an answer.
- `addition`: examples/agent/calc_agent.py as bench/agent_learn.py trains it: "What is A + B?" (the `addition`
  task, 100..999) with `tool_prompt: system` (tidal writes the `add` tool's Hermes block into the program's system
  message and its results back as a user turn of `<tool_response>` blocks); `--model` the policy (e.g. the
  agent-learn runs' warm start with an RL adapter merged in: it calls the tool, ~2 calls a session). The twin's
  system message and tool results are written the same way (`tidal.envs.agent.toolprompt.with_tools_in_system`).
- `reverse`: the bundled model with its tag tokens renamed (`tests.e2e.agent_env.calling_tool_model`: untrained, it
  writes `<tool_call>{"name": "reverse", "arguments": {"text": "..."}}</tool_call>`), reverse-text's prompts and
  bench/agent_reverse.py's `reverse(text)` tool. A model ~100x cheaper per token than SmolLM2, so the endpoint's
  own cost per call weighs most here: the worst case.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    from examples.agent.calc_agent import add as program_add

    return str(program_add(a, b))


def reverse(text: str) -> str:
    """Reverse a text.

    Args:
        text: the text to reverse
    """
    from agent_reverse import reverse as program_reverse

    return str(program_reverse(text))


def call_text(a: int, b: int) -> str:
    return f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


SHOTS = [{"role": "user", "content": "What is 12 + 30 + 7? Answer with a number."},
         {"role": "assistant", "content": call_text(12, 30)}, {"role": "tool", "content": "42"},
         {"role": "assistant", "content": call_text(42, 7)}, {"role": "tool", "content": "49"},
         {"role": "assistant", "content": "49"}]
"""One worked conversation (`--shots`): the tool calls written as the model writes them (SmolLM2's template renders
an assistant message's content only)."""


def tasks() -> dict[str, Any]:
    """The task environments (classes defined here, registered when first built)."""
    from tidal.envs.addition import last_integer
    from tidal.envs.base import Environment, Example

    class Sum3(Environment):
        """'What is A + B + C? Answer with a number.' (A, B, C in [low, high]); reward: the last integer is the sum."""

        id = "bench-sum3"

        def __init__(self, low: int = 100, high: int = 999, shots: bool = True) -> None:
            self.low, self.high, self.shots = low, high, shots

        def sample(self, rng: random.Random) -> Example:
            a, b, c = (rng.randint(self.low, self.high) for _ in range(3))
            prompt = [*(SHOTS if self.shots else []),
                      {"role": "user", "content": f"What is {a} + {b} + {c}? Answer with a number."}]
            return Example(prompt=prompt, answer=str(a + b + c), info={"a": a, "b": b, "c": c})

        def reward(self, example: Example, completion: str) -> float:
            return float(last_integer(completion) == example.answer)

    from tidal.envs.addition import Addition
    from tidal.envs.reverse_text import ReverseText

    return {"bench-sum3": Sum3, "reverse-text": ReverseText, "addition": Addition}


@dataclass
class Workload:
    """One workload (module doc)."""

    name: str
    model: str
    task: dict[str, Any]
    """The task environment (`{id, args}`), as the agent env's `task`."""
    function: str
    """The program as a function (`AgentArgs.function`)."""
    shared: str
    """The same program with one client for every session (bench/agent_shared.py), as a function."""
    command: list[str]
    """The program as a command (`AgentArgs.command`)."""
    system: str | None
    """The system message the program puts before the example's prompt (None: it sends the prompt as it is)."""
    tool: Any
    tool_prompt: str = "program"
    """The agent env's `tool_prompt` (`program`: the program's prompt describes its tool; `system`: tidal writes it
    into the system message, and the twin too)."""

    def program_tool(self) -> Any:
        """The program's own tool function, as its loop calls it (`fn(**arguments)`, whatever name the call gives)."""
        if self.name == "reverse":
            from agent_reverse import reverse as program_reverse

            return program_reverse
        from examples.agent.calc_agent import add as program_add

        return program_add

    def build_task(self) -> Any:
        return tasks()[self.task["id"]](**self.task["args"])

    def envs(self) -> dict[str, Any]:
        """{side: environment}: the tool loop's twin and the endpoint's agent env, program as function / command."""
        from tidal.envs.agent.env import make_agent
        from tidal.envs.agent.toolprompt import tools_block, with_tools_in_system
        from tidal.envs.base import Environment, Example
        from tidal.envs.tools import Tooling

        task, system, tool, in_system = self.build_task(), self.system, self.tool, self.tool_prompt == "system"
        program_tool = self.program_tool()
        if in_system:  # as the endpoint renders the program's system message with its tools (module doc)
            from examples.agent.calc_agent import TOOLS

            system = (system + "\n\n" if system else "") + tools_block(TOOLS)

        class AsTheProgramSees(Tooling):
            """The tool answered as the program answers it: every call, whatever tool it names, runs the program's
            own function on the call's arguments (the program's loop does; the tool loop's session would answer an
            unknown name or arguments the typed signature refuses with its own `{"error": ...}`), and a turn whose
            calls do not all parse ends the rollout (the endpoint answers such a turn as plain text, no
            `tool_calls`, so the program stops there; the tool loop would answer with an error and go on)."""

            def open(self, row: dict[str, Any]) -> Any:
                session = super().open(row)

                async def after_turn(history: list[dict[str, Any]], calls: list[Any]) -> Any:
                    if not calls or any(c.error is not None for c in calls):
                        return None
                    results = [{"role": "tool", "name": c.name, "content": program_tool(**c.arguments)}
                               for c in calls]
                    return with_tools_in_system(results, None) if in_system else results

                session.after_turn = after_turn  # type: ignore[method-assign]
                return session

        class Twin(Environment):
            """The program's conversation in process: its system prompt + the example's prompt, its tool."""

            id = f"bench-twin-{self.name}"
            tooling = AsTheProgramSees([tool], fmt="hermes", max_iterations=2)
            render_tools = not in_system
            """Whether the prompt is rendered with the tools' schemas (`tools=`): not where the system message
            carries them (as the endpoint renders `tool_prompt: system`)."""

            def sample(self, rng: random.Random) -> Example:
                return self.prompted(task.sample(rng))

            def prompted(self, ex: Example) -> Example:
                head = [{"role": "system", "content": system}] if system is not None else []
                return Example(prompt=[*head, *ex.prompt], answer=ex.answer, info=ex.info)

            def reward(self, example: Example, completion: str) -> float:
                return task.reward(example, completion)

        common: dict[str, Any] = {"task": self.task, "max_calls": 4, "timeout_s": 600, "tool_format": "hermes"}
        from tidal.config.agent import AgentArgs

        if "tool_prompt" in AgentArgs.model_fields:  # where the endpoint checks templates that ignore tools: the
            common["tool_prompt"] = self.tool_prompt  # program (`program`) or tidal (`system`) describes them

        def build(id_: str, args: dict[str, Any]) -> Any:
            return tasks()[id_](**args)

        return {"toolloop": Twin(),
                "endpoint-fn": make_agent({"function": self.function, **common}, build),
                "endpoint-fn-shared": make_agent({"function": self.shared, **common}, build),
                "endpoint-cmd": make_agent({"command": self.command, **common}, build)}


def workload(name: str, model: str | None, work: Path, shots: bool) -> Workload:
    """The workload `name` (module doc); `model`: another model than the workload's own; `work`: where the reverse
    workload writes its model."""
    if name == "calc":
        from examples.agent.calc_agent import SYSTEM

        return Workload("calc", model or "tidal:smollm2-135m-instruct",
                        {"id": "bench-sum3", "args": {"low": 100, "high": 999, "shots": shots}},
                        "examples.agent.calc_agent:main", "agent_shared:calc_main",
                        [sys.executable, str(REPO / "examples/agent/calc_agent.py")], SYSTEM, add)
    if name == "addition":
        from examples.agent.calc_agent import SYSTEM

        return Workload("addition", model or "tidal:smollm2-135m-instruct",
                        {"id": "addition", "args": {"low": 100, "high": 999}},
                        "examples.agent.calc_agent:main", "agent_shared:calc_main",
                        [sys.executable, str(REPO / "examples/agent/calc_agent.py")], SYSTEM, add, "system")
    if name == "reverse":
        if model is None:
            import importlib

            sys.path.insert(0, str(REPO))
            dst = work / "calling-tool-model"
            if not (dst / "tokenizer.json").exists():  # the tests' model (a module mypy does not check)
                importlib.import_module("tests.e2e.agent_env").calling_tool_model(dst)
            model = str(dst)
        return Workload("reverse", model, {"id": "reverse-text", "args": {"min_len": 4, "max_len": 12}},
                        "bench.agent_reverse:main", "agent_shared:reverse_main",
                        [sys.executable, str(REPO / "bench/agent_reverse.py")], None, reverse)
    raise ValueError(f"unknown workload {name!r} (calc, addition, reverse)")
