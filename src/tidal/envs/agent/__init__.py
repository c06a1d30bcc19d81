"""Train a user's own agent program unchanged: an OpenAI- and Anthropic-compatible session endpoint with exact tokens.

`env: [{id: agent, args: {command: [...] | function: pkg.mod:fn, task: {id: ..., args: {...}}, ...}}]`
(`tidal.config.agent.AgentArgs`, docs/agents.md). Modules: `env` (the environment kind, scoring, counters),
`session` (one rollout's calls stitched into rows), `server` (the HTTP endpoint), `wire` (the two APIs' formats),
`program` (running the user's program). The orchestrator samples a group through `tidal.orchestrator.agentloop`.
"""

from tidal.envs.agent.env import AgentEnv, make_agent

__all__ = ["AgentEnv", "make_agent"]
