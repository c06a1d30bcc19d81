"""A broken agent program stops the run at once (`tidal.envs.agent.env.AgentProgramBroken`), where an environment
outage would be waited out for `env_outage.timeout_s`: the run's first `BROKEN_AFTER` sessions failed before any model
call. Real sessions on the real endpoint; the programs fail before calling the model, so no model is needed."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from tidal.config.orch import SamplingSection
from tidal.envs import make_env
from tidal.envs.agent.env import BROKEN_AFTER, AgentProgramBroken
from tidal.envs.base import Example
from tidal.orchestrator.agentloop import agent_group

EXAMPLE = Example(prompt=[{"role": "user", "content": "hello"}], answer="olleh", info={"text": "hello"})


def broken_import(base_url: str, api_key: str, example: dict[str, Any]) -> None:
    """A program with a bug before its first call (a deterministic failure in every session)."""
    raise ImportError("No module named 'my_agent_lib'")


def groups(env: Any, sizes: list[int]) -> list[str | None]:
    """Run one group per size (no client: these programs never call the model); per group the exception's text or
    None."""
    async def go() -> list[str | None]:
        out: list[str | None] = []
        try:
            for n in sizes:
                try:
                    await agent_group(None, "policy", [1, 2, 3], n, SamplingSection(), 256, None, 1.0,  # type: ignore[arg-type]
                                      env, EXAMPLE)
                    out.append(None)
                except AgentProgramBroken as exc:
                    out.append(str(exc))
        finally:
            await env.server.stop()
        return out

    return asyncio.run(go())


def test_a_program_failing_every_session_before_its_first_call_stops_the_run_naming_the_failure():
    env = make_env("agent", {"task": {"id": "reverse-text"}, "function": f"{__name__}:broken_import"})
    half = BROKEN_AFTER // 2
    got = groups(env, [half, BROKEN_AFTER - half - 1, 1])
    assert got[:2] == [None, None], "fewer sessions than BROKEN_AFTER: failed episodes, as before"
    assert got[2] is not None and "failed its first 8 sessions before any model call" in got[2]
    assert "ImportError: No module named 'my_agent_lib'" in got[2] and "broken_import" in got[2]
    assert env.take_metrics()["agent/failures"] == BROKEN_AFTER


def test_a_command_that_exits_non_zero_at_once_is_stopped_with_its_stderr():
    env = make_env("agent", {"task": {"id": "reverse-text"},
                             "command": [sys.executable, "-c", "import sys; sys.exit('no OPENAI key handling here')"]})
    got = groups(env, [BROKEN_AFTER])
    assert got[0] is not None and "exited with code 1: no OPENAI key handling here" in got[0]
    assert sys.executable in got[0], "the message names the program"


def test_once_a_session_has_called_the_model_failures_are_episodes_again():
    """After a model call the same failures are failed episodes (judged by the outage rules), never a stop: the
    program ran before, so it is not simply broken. (With real calls on vLLM:
    tests/integration/test_agent_endpoint.py; here the run's state after one is set as `run_session` sets it.)"""
    env = make_env("agent", {"task": {"id": "reverse-text"}, "function": f"{__name__}:broken_import"})
    env.called = True
    assert groups(env, [BROKEN_AFTER, BROKEN_AFTER]) == [None, None]
    assert env.take_metrics()["agent/failures"] == 2 * BROKEN_AFTER
