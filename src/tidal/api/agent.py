"""`GRPOTrainer(agent=...)`: train the user's own agent program, as the `agent` environment does for `tidal grpo`.

    trainer = GRPOTrainer(model=..., args=GRPOConfig(...), train_dataset=rows, agent=my_agent)

`agent` is the program: a callable `fn(base_url, api_key, example)` (sync or async; closures and lambdas work: the
orchestrator runs in the script's process, `tidal.envs.agent.program.import_path_of`), a command (a string split like
a shell would, or a list of arguments) run once per rollout with the `OPENAI_*` / `ANTHROPIC_*` variables, or a dict of
`tidal.config.agent.AgentArgs` keys (`command` or `function`, which may be a callable, plus `timeout_s`, `max_calls`,
`train_forks`, ...; not `task`). Each rollout is a session of the endpoint (docs/agents.md): examples are the
`train_dataset` rows (the `dataset` environment, its columns in `example["info"]`); the rows, forks, masks and
failures are the agent environment's. Rewards: with `reward_funcs`, they score the session's messages (the last
assistant answer's conversation) and agent `reward` defaults to `task` (the dataset has no reward of its own: the
functions alone); without them it defaults to `program` (the number the callable returns or the command POSTs; an
episode without one fails). `reward: program` with `reward_funcs` adds the program's reward as a column of its own.
"""

from __future__ import annotations

from typing import Any

from tidal.config.agent import AgentArgs
from tidal.envs.agent.program import import_path_of


def agent_args(agent: Any, with_reward_funcs: bool) -> dict[str, Any] | None:
    """The agent environment's args (without `task`) for `GRPOTrainer(agent=...)` (module doc), or None; a
    ValueError / TypeError names what is wrong."""
    if agent is None:
        return None
    if callable(agent):
        out: dict[str, Any] = {"function": agent}
    elif isinstance(agent, str) or isinstance(agent, list | tuple) and all(isinstance(a, str) for a in agent):
        out = {"command": agent if isinstance(agent, str) else list(agent)}
    elif isinstance(agent, dict):
        out = dict(agent)
        if "task" in out:
            raise ValueError("GRPOTrainer(agent={...}): 'task' is the train_dataset; leave it out")
    else:
        raise TypeError(f"GRPOTrainer(agent=...) must be a callable fn(base_url, api_key, example), a command (a "
                        f"string or a list of strings) or a dict of agent args, got a {type(agent).__name__}")
    if callable(out.get("function")):
        out["function"] = import_path_of(out["function"])
    out.setdefault("reward", "task" if with_reward_funcs else "program")
    if out["reward"] == "auto":
        raise ValueError("GRPOTrainer(agent={'reward': 'auto'}): the train_dataset has no reward of its own; choose "
                         "'program' (the program's reward) or 'task' (the reward_funcs alone)")
    AgentArgs.model_validate({**out, "task": {"id": "dataset"}})  # errors name the key, before anything starts
    return out
