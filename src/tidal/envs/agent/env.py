"""The `agent` environment: examples and rewards of a task environment, rollouts by the user's own agent program.

Each rollout is a session (`tidal.envs.agent.session`) on the endpoint (`tidal.envs.agent.server`) that the
program (`tidal.envs.agent.program`) talks to with the plain OpenAI or Anthropic SDK; `run_session` runs one and
counts what happened (`take_metrics`: `agent/sessions`, `agent/calls`, `agent/forks`, `agent/rows`,
`agent/off_policy_calls`, `agent/failures`). Scoring (`score_rollouts`): by `AgentArgs.reward`, the program's
reward or the task environment's reward of the session's last assistant answer. An episode that failed (the program
exited non-zero, raised, ran past `timeout_s`, broke `max_calls` or the token budget, made no call, or gave no reward
under `reward: program`) is the environment's failure: not judged, no loss, outside its group's baseline
(`Completion.env_error`), and counted. A program that is broken rather than down - the run's first
`BROKEN_AFTER` sessions all failed before any model call, and no session has made one yet - stops the run at once
(`AgentProgramBroken`, naming the first failure), instead of being waited out as an environment outage
(`env_outage.timeout_s`): nothing has been trained, so nothing is lost.
"""

from __future__ import annotations

import logging
import random
import secrets
from typing import Any

from tidal.config.agent import AgentArgs
from tidal.config.environments import check_args
from tidal.envs.agent.program import Program, environment
from tidal.envs.agent.server import AgentServer
from tidal.envs.agent.session import Backend, Session
from tidal.envs.base import Environment, Example
from tidal.envs.remote import example_to_json

log = logging.getLogger("tidal.agent")

BROKEN_AFTER = 8
"""Sessions failed before their first model call, with no session of the run having made one, that stop the run."""
COUNTERS = ("agent/sessions", "agent/calls", "agent/forks", "agent/rows", "agent/off_policy_calls", "agent/failures")


class AgentProgramBroken(RuntimeError):
    """The agent program failed its first `BROKEN_AFTER` sessions before any model call (module doc): the run stops
    (`tidal grpo-orch` exits 1 with this message)."""


class AgentEnv(Environment):
    """See the module doc; `task`: the environment built from `args.task`."""

    id = "agent"

    def __init__(self, args: AgentArgs, task: Environment) -> None:
        self.args, self.task = args, task
        self.program = Program(args.command, args.function, args.timeout_s)
        self.server = AgentServer(args.model, args.tool_format, args.max_concurrency, args.port,
                                  args.tool_prompt)
        self.counts = dict.fromkeys(COUNTERS, 0.0)
        self.has_reward = args.reward == "program" or task.has_reward
        self.said_ignored = False
        self.called = False
        """Whether any session of this run has made a model call."""
        self.silent_failures: list[str] = []
        """Why sessions failed before their first model call, while `called` is False."""

    @property
    def uses_program_reward(self) -> bool:
        """Whether a reward the program reports scores its session (`reward: program`, or `auto` with a task that
        has a reward column); else it is ignored, and said once."""
        return self.args.reward == "program" or self.args.reward == "auto" and self.has_reward

    def sample(self, rng: random.Random) -> Example:
        return self.task.sample(rng)

    def reward(self, example: Example, completion: str) -> float:
        return self.task.reward(example, completion)

    def reward_columns(self, example: Example) -> dict[str, Any]:
        return self.task.reward_columns(example)

    def eval_examples(self) -> list[Example] | None:
        return self.task.eval_examples()

    def score_rollouts(self, example: Example, rollouts: list[Any]) -> list[float]:
        """Per rollout (its `environment` is its `Session`): the program's reward (`reward: program`, or `auto` when
        it gave one), else the task's reward of the last assistant answer (`Completion.text`)."""
        out = []
        for r in rollouts:
            s: Session | None = r.environment
            if s is not None and s.reward is not None and self.args.reward != "task":
                out.append(s.reward)
            elif self.args.reward == "program":
                out.append(0.0)  # a failed episode: not judged (its env_error), the value is never used
            else:
                out.append(self.task.reward(example, r.text))
        return out

    def new_session(self, example: Example, seq_len: int) -> Session:
        return Session(secrets.token_hex(12), example_to_json(example), self.args.max_calls,
                       self.args.max_session_tokens, seq_len)

    async def run_session(self, session: Session, backend: Backend) -> None:
        """Run the program once in `session` (open on the endpoint meanwhile); sets `session.failure` when the
        episode failed (module doc), and counts it."""
        await self.server.ensure_started()
        self.server.open(session, backend)
        try:
            openai_url, anthropic_url = self.server.urls(session)
            env = environment(openai_url, anthropic_url, session.key, self.args.model, session.example)
            failure, reward = await self.program.run(env, session.example)
        finally:
            self.server.close(session)
        if reward is not None:
            session.reward = reward
        if session.reward is not None and not self.uses_program_reward and not self.said_ignored:
            self.said_ignored = True
            log.warning("the agent program reported a reward, which this run does not use: agent args.reward is "
                        "%r and %s; set reward: program to train on it (said once)", self.args.reward,
                        "the task's reward scores" if self.args.reward == "task" else
                        f"the task environment '{self.task.id}' has no reward of its own")
        session.failure = session.failure or failure
        if session.failure is None and not session.rows:
            session.failure = "the program made no model call"
        if session.failure is None and self.args.reward == "program" and session.reward is None:
            session.failure = ("the program reported no reward (agent args.reward: program): return a number, or "
                               "POST {\"reward\": x} to TIDAL_AGENT_REWARD_URL")
        self.called = self.called or session.calls > 0
        if session.failure is not None and session.calls == 0 and not self.called:
            self.silent_failures.append(session.failure)
        c = self.counts
        c["agent/sessions"] += 1
        c["agent/calls"] += session.calls
        c["agent/forks"] += session.forks
        c["agent/rows"] += len(session.rows)
        c["agent/off_policy_calls"] += session.off_policy_calls
        c["agent/failures"] += session.failure is not None

    def stop_if_broken(self) -> None:
        """AgentProgramBroken when the program is broken rather than down (module doc); called after each group."""
        if not self.called and len(self.silent_failures) >= BROKEN_AFTER:
            program = " ".join(self.program.argv) if self.program.argv else self.args.function
            raise AgentProgramBroken(
                f"the agent program ({program}) failed its first {len(self.silent_failures)} sessions before any "
                f"model call, so it is broken rather than an environment outage; nothing was trained. The first "
                f"failure: {self.silent_failures[0][:1500]}")

    def take_metrics(self) -> dict[str, float]:
        """The counters since the last call (then reset)."""
        out, self.counts = self.counts, dict.fromkeys(COUNTERS, 0.0)
        return out


def make_agent(args: dict[str, Any], build: Any) -> AgentEnv:
    """An AgentEnv from orch `args` (validated as `AgentArgs`); `build(id, args)`: makes the task environment."""
    parsed: AgentArgs = check_args(AgentArgs, "environment 'agent'", args)
    return AgentEnv(parsed, build(parsed.task.id, parsed.task.args))
