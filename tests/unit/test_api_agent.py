"""`GRPOTrainer(agent=...)` (`tidal.api.agent`): the user's agent program as the run's environment, the train rows as
its examples, rewards by the reward functions or the program; closures run where they live (an in-process import
path); what cannot combine is refused by name."""

from __future__ import annotations

import asyncio
import sys

import pytest

from tidal import GRPOConfig, GRPOTrainer
from tidal.api.agent import agent_args
from tidal.envs.agent import AgentEnv
from tidal.envs.agent.program import Program, import_path_of
from tidal.envs.tools import load_object

ROWS = [{"prompt": [{"role": "user", "content": "abc"}], "answer": "cba"},
        {"prompt": [{"role": "user", "content": "xy"}], "answer": "yx"}]


def length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def make(**kw):
    args = kw.pop("args", GRPOConfig(num_generations=2, per_device_train_batch_size=4))
    return GRPOTrainer(**{"model": "tidal:tiny-reverse", "args": args, "train_dataset": ROWS, "peft_config": None,
                          **kw})


def test_a_closure_becomes_the_agent_env_of_the_run_with_the_rows_as_examples(tmp_path):
    from tidal.orchestrator.preflight import build_scoring

    seen = []

    def program(base_url, api_key, example):  # a closure: runs in this process
        seen.append(example["answer"])
        return 0.5

    t = make(agent=program)
    assert t.agent is not None and t.agent["reward"] == "program", "no reward_funcs: the program's reward"
    assert t.reward_funcs == []
    scoring = build_scoring(t.with_data(t.derived.orch, tmp_path), t.reward_funcs)
    env = scoring.env.envs["agent"]
    assert isinstance(env, AgentEnv) and env.program.fn is program
    ex = env.sample(__import__("random").Random(0))
    assert ex.answer in ("cba", "yx") and env.task.id == "dataset"
    assert asyncio.run(env.program.run({"OPENAI_BASE_URL": "u", "OPENAI_API_KEY": "k"}, {"answer": "cba"})) == (
        None, 0.5)
    assert seen == ["cba"]
    assert scoring.scorer.names == ["agent"], "the program's reward is the reward column"


def test_with_reward_funcs_they_score_and_a_command_runs(tmp_path):
    from tidal.orchestrator.preflight import build_scoring

    t = make(agent=f"{sys.executable} -m tests.e2e.agent_env", reward_funcs=length)
    assert t.agent == {"command": f"{sys.executable} -m tests.e2e.agent_env", "reward": "task"}
    scoring = build_scoring(t.with_data(t.derived.orch, tmp_path), t.reward_funcs)
    env = scoring.env.envs["agent"]
    assert env.program.argv == [sys.executable, "-m", "tests.e2e.agent_env"]
    assert scoring.scorer.names == ["length"], "the functions alone (the dataset has no reward of its own)"
    both = make(agent={"command": [sys.executable], "reward": "program", "timeout_s": 5, "train_forks": False},
                reward_funcs=length)
    env = build_scoring(both.with_data(both.derived.orch, tmp_path / "b"), both.reward_funcs).env.envs["agent"]
    assert env.args.timeout_s == 5 and env.args.train_forks is False and env.has_reward


def test_eval_datasets_are_evaluated_through_the_program(tmp_path):
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=4, eval_strategy="steps")
    t = make(agent=lambda base_url, api_key, example: 1.0, eval_dataset=ROWS, args=args)
    orch = t.with_data(t.derived.orch, tmp_path)
    assert orch.eval is not None and [(e.id, e.name) for e in orch.eval.env] == [("agent", "eval")]
    assert orch.eval.env[0].args["task"]["args"]["path"].endswith("eval.jsonl")


def test_import_paths_of_callables():
    assert import_path_of(length) == "tests.unit.test_api_agent:length"
    fn = lambda base_url, api_key, example: None  # noqa: E731
    path = import_path_of(fn)
    assert path.startswith("tidal.envs.agent.program:local_") and load_object(path, "x") is fn
    assert Program(None, path, 1.0).fn is fn


@pytest.mark.parametrize(("kw", "error", "match"), [
    ({"agent": 3}, TypeError, r"agent=...\) must be a callable"),
    ({"agent": {"command": "x", "task": {"id": "dataset"}}}, ValueError, "'task' is the train_dataset"),
    ({"agent": {"function": length, "reward": "auto"}}, ValueError, "has no reward of its own"),
    ({"agent": {"function": length, "timeout_s": -1}}, ValueError, "timeout_s"),
    ({"agent": length, "tools": [length]}, ValueError, "owns its loop and tools"),
])
def test_bad_agents_are_refused_by_name(kw, error, match):
    with pytest.raises(error, match=match):
        make(**kw)


def test_agent_args_maps_each_form():
    assert agent_args(None, False) is None
    assert agent_args(["python", "a.py"], True) == {"command": ["python", "a.py"], "reward": "task"}


def test_a_program_reward_is_used_only_where_it_scores():
    from tidal.envs import make_env

    def env(reward, task="reverse-text"):
        return make_env("agent", {"command": [sys.executable], "reward": reward, "task": {"id": task, "args": (
            {"path": "x"} if task == "dataset" else {})}})

    assert env("program").uses_program_reward and env("auto").uses_program_reward
    assert not env("task").uses_program_reward
