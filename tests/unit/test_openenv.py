"""OpenEnv environments (`tidal.envs.openenv`) against a real OpenEnv server on localhost: the small reverse-text
environment of `tests.e2e.openenv_reverse`, written with openenv-core's `create_app`, served by uvicorn in a thread
(or by tidal itself from `args.app`). Rollouts go through tidal's real tool loop (`toolloop.tool_group`) with a
scripted inference client whose chat rendering is the bundled model's template, so the spliced observation tokens
are checked against the template. Covers single- and multi-turn episodes, rewards, the session slots, and every
kind of server failure (a step that raises, a timeout, a refused connection, a failing reset, a reset that does not
reproduce the prompt), each an unjudged rollout (`Completion.env_error`) and never raised; a step that fails after
the model's action charged to the model while the server's /health answers (`args.action_failures`) and to the
environment when the action killed the server; invalid actions; the config keys; and tidal without openenv-core
(the `openenv` extra)."""

from __future__ import annotations

import asyncio
import math
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("openenv.core", reason="openenv-core is the optional `openenv` extra: pip install 'tidal[openenv]'")

import uvicorn  # noqa: E402

from tests.conftest import free_port  # noqa: E402
from tests.e2e import openenv_reverse  # noqa: E402
from tidal.config.load import ConfigError, validate  # noqa: E402
from tidal.config.orch import OrchConfig, SamplingSection  # noqa: E402
from tidal.envs.openenv import Episode, OpenEnv  # noqa: E402
from tidal.inference.protocol import Completion  # noqa: E402
from tidal.orchestrator.scoring import Scorer  # noqa: E402
from tidal.orchestrator.toolloop import tool_group  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "Reverse the text."
ID = "tidal.envs.openenv:OpenEnv"


class Served:
    """`app` served by uvicorn in a daemon thread on a free port until `stop`."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def server():
    s = Served(openenv_reverse.app)
    yield s.url
    s.stop()


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from tidal.models.sources import bundled

    return AutoTokenizer.from_pretrained(bundled("tidal:tiny-reverse"))


class ScriptedClient:
    """What `tool_group` asks of an InferenceClient: rollout i's k-th turn is `scripts[i][k]` (recognised by the turn
    seeds the loop derives: seed + 7919 * k + i), sampled as its tokens + the end-of-turn token; chats rendered by the
    tokenizer's own chat template (what vLLM's /tokenize does)."""

    def __init__(self, tok, scripts: list[list[str]]) -> None:
        self.tok, self.scripts, self.seed0 = tok, scripts, 0
        self.eos = tok.convert_tokens_to_ids("<|im_end|>")

    async def tokenize_chat(self, model, messages, tools=None, add_generation_prompt=True):
        return list(self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                                 return_dict=False))

    async def tokenize_prompt(self, model, prompt, tools=None):
        return await self.tokenize_chat(model, prompt, tools)

    async def sample(self, model, prompt_ids, n, max_tokens, temperature, seed=None, extra=None):
        if n == len(self.scripts):
            self.seed0 = seed
            texts = [s[0] for s in self.scripts]
        else:
            k, i = divmod(seed - self.seed0, 7919)
            texts = [self.scripts[i][k]]
        await asyncio.sleep(0.01)
        return [self.completion(t, max_tokens) for t in texts]

    def completion(self, text: str, max_tokens: int) -> Completion:
        ids = [*self.tok.encode(text, add_special_tokens=False), self.eos]
        finish = "stop"
        if len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
        pieces = [self.tok.decode([t]) for t in ids]
        return Completion(ids, [-0.5] * len(ids), "".join(pieces), finish, pieces)


def rollouts(env: OpenEnv, tok, scripts: list[list[str]], seed: int = 0, max_tokens: int = 400):
    """`len(scripts)` rollouts of one example of `env` through the tool loop; (example, prompt ids, completions)."""
    ex = env.sample(random.Random(seed))
    client = ScriptedClient(tok, scripts)

    async def run():
        prompt_ids = await client.tokenize_prompt("m", ex.prompt)
        comps = await tool_group(client, "m", prompt_ids, len(scripts), SamplingSection(max_tokens=max_tokens), 1024,
                                 100, 1.0, env, ex)
        await asyncio.sleep(0.1)  # sessions closed by the rollouts' task callbacks finish closing
        return prompt_ids, comps

    prompt_ids, comps = asyncio.run(run())
    return ex, prompt_ids, comps


def answer(ex) -> str:
    return f"<reversed_text>{ex.prompt[-1]['content'][::-1]}</reversed_text>"


def make(url: str, **args) -> OpenEnv:
    return OpenEnv(**{"base_url": url, "system_prompt": SYSTEM, "max_sessions": 8, "timeout_s": 10, **args})


def test_single_turn_episode(server, tok):
    env = make(server)
    ex = env.sample(random.Random(0))
    assert ex.prompt[0] == {"role": "system", "content": SYSTEM} and ex.prompt[1]["role"] == "user"
    assert env.sample(random.Random(0)).prompt == ex.prompt, "the same seed draws the same first observation"
    ex, _, comps = rollouts(env, tok, [[answer(ex)], ["<reversed_text>qq</reversed_text>"]])
    assert [[m["role"] for m in c.messages] for c in comps] == [["assistant"], ["assistant"]]
    assert all(set(c.mask) == {1} for c in comps), "one model turn, no environment tokens"
    eps = [c.environment for c in comps]
    assert all(isinstance(e, Episode) and len(e.actions) == 1 and e.error is None for e in eps)
    assert eps[0].actions[0] == {"message": answer(ex)} and eps[0].done
    assert env.score_rollouts(ex, comps) == [1.0, 0.0]
    assert env.tooling.slots.sem is not None and env.tooling.slots.sem._value == 8, "every session was closed"


def test_multi_turn_episode_tokens_and_rewards(server, tok):
    env = make(server, max_turns=3)
    ex = env.sample(random.Random(1))
    wrong = "<reversed_text>q</reversed_text>"
    ex, prompt_ids, comps = rollouts(env, tok, [[wrong, answer(ex)], [wrong, wrong, wrong, "never sampled"]], seed=1)
    roles = [[m["role"] for m in c.messages] for c in comps]
    assert roles[0] == ["assistant", "user", "assistant"], "done after the exact answer"
    assert roles[1] == ["assistant", "user", "assistant", "user", "assistant"], "max_turns 3 ended it"
    text = ex.prompt[-1]["content"]
    assert comps[0].messages[1]["content"] == f"Not quite (0.00). Reverse it again: {text}"
    for c in comps:  # the loop's tokens are exactly the chat template's rendering of the conversation
        full = tok.apply_chat_template(ex.prompt + c.messages, tokenize=True, return_dict=False)
        assert prompt_ids + c.token_ids == full[:len(prompt_ids) + len(c.token_ids)]
        assert tok.decode(full[len(prompt_ids) + len(c.token_ids):]) == "\n"
        env_tokens = [t for t, m in zip(c.token_ids, c.mask, strict=True) if m == 0]
        assert tok.decode(env_tokens).startswith("\n<|im_start|>user\nNot quite")
    assert env.score_rollouts(ex, comps) == [1.0, 0.0]
    eps = [c.environment for c in comps]
    assert eps[0].rewards == [0.0, 1.0] and eps[1].rewards == [0.0, 0.0, 0.0]
    assert Episode(0, rewards=[0.5, None, 0.25]).total("sum") == 0.75
    assert Episode(0, rewards=[0.5, 0.25]).total("last") == 0.25 and Episode(0).total("sum") == 0.0


def test_one_session_slot_serves_every_rollout_and_truncated_turns_close(server, tok):
    """max_sessions 1: rollouts wait for the slot (no deadlock); a rollout whose second turn is cut by the token
    budget never reaches after_turn again, and its task's callback closes its session (the slot comes back)."""
    env = OpenEnv(base_url=server, max_turns=3, max_sessions=1)
    ex = env.sample(random.Random(2))
    long = "<reversed_text>" + "x y " * 40
    ex, _, comps = rollouts(env, tok, [["a", long], ["b", long], [answer(ex)]], seed=2, max_tokens=48)
    assert [c.finish_reason for c in comps] == ["length", "length", "stop"]
    assert env.score_rollouts(ex, comps) == [0.0, 0.0, 1.0]
    assert env.tooling.slots.sem._value == 1 and not env.tooling.closing


def actions_taken(environments, openenv_seed, **kwargs) -> list[float]:
    """A reward function over the rollouts' episodes (TRL's `environments` keyword) and the seed column."""
    assert all(e.seed == s for e, s in zip(environments, openenv_seed, strict=True))
    return [float(len(e.actions)) for e in environments]


def scorer_of(env: OpenEnv, url: str) -> Scorer:
    cfg = validate(OrchConfig, {"env": [{"id": ID, "args": {"base_url": url}}], "reward_default": -1.0,
                                "reward_funcs": [{"import_path": "tests.unit.test_openenv:actions_taken"}]},
                   "orch.yaml")
    return Scorer({"openenv": env}, cfg)


def test_server_failures_are_unjudged_rollouts_not_errors(server, tok, caplog):
    """With `action_failures: environment`, every failed step is the environment's, healthy server or not."""
    env = make(server, max_turns=2, timeout_s=1.0, action_failures="environment")
    ex = env.sample(random.Random(3))
    ex, _, comps = rollouts(env, tok, [["BOOM"], ["ok", "SLOW"], [answer(ex)]], seed=3)
    eps = [c.environment for c in comps]
    assert "EXECUTION_ERROR" in eps[0].error and "the environment broke" in eps[0].error
    assert eps[1].error is not None and "TimeoutError" in eps[1].error and eps[1].rewards == [0.0]
    assert eps[2].error is None
    assert [c.env_error is not None for c in comps] == [True, True, False]
    assert comps[0].env_error.startswith(f"OpenEnv environment at {server}: RuntimeError")
    scores = env.score_rollouts(ex, comps)
    assert math.isnan(scores[0]) and math.isnan(scores[1]) and scores[2] == 1.0
    scorer = scorer_of(env, server)
    ex.task = "openenv"
    scores = scorer.score(ex, comps, 1)
    assert np.isnan(scores[:2]).all(), "failed episodes are not judged: no reward_default, no reward function"
    assert scores[2].tolist() == [1.0, 1.0], "the judged episode: the server's reward and the reward function's"
    assert scorer.take_error_counts()["reward/openenv/errors"] == 0.0
    assert env.failures["server failure"] == 2
    assert "OpenEnv environment at" in caplog.text and "logged once" in caplog.text


def test_actions_that_break_or_hang_a_healthy_server_are_the_models_failures(server, tok, caplog):
    """`action_failures: model` (the default): a step that raises or hangs after the model's action, the server's
    /health still answering, is the model's failure: judged, scored `action_failure_reward`, trained on."""
    env = make(server, max_turns=2, timeout_s=1.0, action_failure_reward=-2.0)
    ex = env.sample(random.Random(3))
    ex, _, comps = rollouts(env, tok, [["BOOM"], ["ok", "SLOW"], [answer(ex)]], seed=3)
    eps = [c.environment for c in comps]
    assert "the environment broke" in eps[0].action_failure and eps[0].error is None
    assert "TimeoutError" in eps[1].action_failure and eps[1].error is None and eps[1].rewards == [0.0]
    assert eps[2].action_failure is None and eps[2].error is None
    assert all(c.env_error is None for c in comps), "judged: no env_error"
    assert env.score_rollouts(ex, comps) == [-2.0, -2.0, 1.0]
    ex.task = "openenv"
    scorer = scorer_of(env, server)
    scores = scorer.score(ex, comps, 1)
    assert scores[:, 0].tolist() == [-2.0, -2.0, 1.0] and not np.isnan(scores).any()
    assert env.failures["action failure"] == 2 and "server failure" not in env.failures
    assert "after the model's action while the server stayed healthy" in caplog.text


def test_an_action_that_kills_the_server_is_the_environments_failure(tok):
    """The action's step fails and the server's /health fails with it: the environment's failure (not judged)."""
    env = OpenEnv(app="tests.e2e.openenv_reverse:app", max_turns=2, max_sessions=4, timeout_s=5,
                  startup_timeout_s=60)
    try:
        ex, _, comps = rollouts(env, tok, [["DIE"]], seed=11)
        ep = comps[0].environment
        assert ep.action_failure is None and "health probe failed too" in ep.error, ep
        assert comps[0].env_error.startswith("OpenEnv environment at http://127.0.0.1:")
        assert math.isnan(env.score_rollouts(ex, comps)[0])
    finally:
        env.close()


def test_a_failing_reset_and_a_dead_server_never_raise(tok):
    srv = Served(openenv_reverse.app)
    env = make(srv.url, reset_args={"fail": True})
    ex = env.sample(random.Random(4))  # POST /reset answers 500: a placeholder example whose episodes fail
    assert "HTTP 500" in ex.info["openenv_error"]
    _, _, comps = rollouts(env, tok, [["a"], ["b"]], seed=4)
    assert [c.environment.error for c in comps] == [ex.info["openenv_error"]] * 2
    assert all(math.isnan(s) for s in env.score_rollouts(ex, comps))

    env = make(srv.url, max_turns=2)
    ex = env.sample(random.Random(5))
    srv.stop()  # the server dies between the prompt and the episodes: connections are refused
    ex2 = env.sample(random.Random(6))
    assert "ConnectError" in ex2.info["openenv_error"]
    client = ScriptedClient(tok, [["a"], ["b"]])

    async def run():
        ids = await client.tokenize_prompt("m", ex.prompt)
        return await tool_group(client, "m", ids, 2, SamplingSection(max_tokens=32), 512, 100, 1.0, env, ex)

    comps = asyncio.run(run())
    assert all("ConnectionError" in c.environment.error for c in comps), [c.environment.error for c in comps]
    assert all(c.env_error is not None for c in comps) and "ConnectError" in env.unavailable()
    assert env.tooling.slots.sem._value == 8


def test_reset_must_reproduce_the_prompt(server, tok):
    env = make(server, max_turns=2)
    ex = env.sample(random.Random(7))
    session = env.tooling.open({"prompt": [{"role": "user", "content": "something else"}], **ex.info})
    history = [{"role": "user", "content": "something else"}, {"role": "assistant", "content": "x"}]
    assert asyncio.run(session.after_turn(history, [])) is None
    assert "deterministic in its seed" in session.episode.error and session.episode.actions == []


def parse_tagged(text: str) -> dict:
    if "<reversed_text>" not in text:
        raise ValueError("no <reversed_text> tag")
    return {"message": text}


def test_invalid_actions_end_the_episode_without_a_failure(server, tok):
    env = make(server, max_turns=3, action_parser="tests.unit.test_openenv:parse_tagged")
    ex = env.sample(random.Random(8))
    ex, _, comps = rollouts(env, tok, [["<reversed_text>q", "untagged"], [answer(ex)]], seed=8)
    eps = [c.environment for c in comps]
    assert "no <reversed_text> tag" in eps[0].invalid_action and eps[0].error is None and eps[0].rewards == [0.0]
    assert env.score_rollouts(ex, comps) == [0.0, 1.0]
    env = make(server, action_field="text")  # the server's Action model has no `text`: it rejects the step
    _, _, comps = rollouts(env, tok, [["anything"]], seed=9)
    ep = comps[0].environment
    assert "VALIDATION_ERROR" in ep.invalid_action and ep.error is None
    assert env.score_rollouts(ex, comps) == [0.0]


def test_observation_template_and_default_rendering():
    from tidal.envs.openenv.session import ObservationError, render_observation

    assert render_observation({"prompt": "abc", "step": 2}, None) == "abc"
    assert render_observation({"a": "x", "b": "y"}, None) == '{"a": "x", "b": "y"}'
    assert render_observation({"prompt": "abc", "step": 2}, "{prompt} (step {step})") == "abc (step 2)"
    with pytest.raises(ObservationError, match="its fields: prompt, step"):
        render_observation({"prompt": "abc", "step": 2}, "{board}")


def test_app_import_path_is_served_by_tidal_and_stopped(tok):
    env = OpenEnv(app="tests.e2e.openenv_reverse:app", max_turns=2, max_sessions=4, startup_timeout_s=60)
    try:
        ex, _, comps = rollouts(env, tok, [["x", "y"]], seed=10)
        assert ex.info["openenv_error"] is None and comps[0].environment.rewards == [0.0, 0.0]
        proc = env.server.process
        assert proc is not None and proc.proc.poll() is None
    finally:
        env.close()
    assert proc.proc.poll() is not None, "close() stopped the server"
    bad = OpenEnv(app="tests.e2e.no_such_module:app", startup_timeout_s=60)
    with pytest.raises(ValueError, match=r"no_such_module:app. did not start \(exit status"):
        bad.sample(random.Random(0))


def test_config_keys():
    ok = validate(OrchConfig, {"env": [{"id": ID, "args": {"base_url": "http://h:1", "max_turns": 3}}]}, "o.yaml")
    assert ok.env[0].args["max_turns"] == 3
    for args, match in (({"base_url": "http://h:1", "max_turn": 3}, "args.max_turn"),
                        ({}, "exactly one"), ({"base_url": "http://h:1", "app": "a:b"}, "exactly one"),
                        ({"base_url": "http://h:1", "max_turns": 0}, "args.max_turns"),
                        ({"base_url": "http://h:1", "reward": "mean"}, "args.reward"),
                        ({"base_url": "http://h:1", "reset_args": {"seed": 1}}, "may not set seed"),
                        ({"base_url": "http://h:1", "action_failures": "nobody"}, "args.action_failures")):
        with pytest.raises(ConfigError, match=match):
            validate(OrchConfig, {"env": [{"id": ID, "args": args}]}, "o.yaml")
    with pytest.raises(ConfigError, match="args.base_url or args.app, not address"):
        validate(OrchConfig, {"env": [{"id": ID, "address": "http://h:1", "args": {"base_url": "http://h:1"}}]},
                 "o.yaml")
    with pytest.raises(ValueError, match="args.app"):
        OpenEnv(app="no_colon")


def test_tidal_runs_without_openenv_core():
    """The extra is optional: without openenv-core tidal and this module import, and building the environment is an
    error that names the extra."""
    code = ("import sys; sys.modules['openenv'] = None\n"
            "import tidal.envs.openenv, tidal.orchestrator.loop\n"
            "from tidal.envs import make_env\n"
            "try:\n"
            "    make_env('tidal.envs.openenv:OpenEnv', {'base_url': 'http://127.0.0.1:1'})\n"
            "except ValueError as exc:\n"
            "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pip install 'tidal[openenv]'" in out.stdout, out.stdout
