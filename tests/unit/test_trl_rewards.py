"""Reward functions are called as TRL's GRPOTrainer documents: `prompts`, `completions` (strings for standard
prompts, `[{"role": "assistant", "content": ...}]` for conversational ones), `completion_ids`, `trainer_state`
and every dataset column but `prompt` as keyword arguments, one entry per completion; a list of floats back,
None = not applicable (skipped in the weighted sum); `async def` functions; closures given in process.

The functions below are written from TRL's documented contract (docs "Using a custom reward function"), not
copied from anywhere. Also: standard prompts are tokenized as plain text (no chat template; the tokenizer's leading
BOS kept, a trailing EOS dropped) and conversational ones with the chat template, through a stand-in for vLLM's
`/tokenize`."""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest

from tidal.config import OrchConfig
from tidal.config.orch import ClientSection
from tidal.envs import make_env
from tidal.inference.backends.vllm.client import VllmClient
from tidal.inference.protocol import Completion
from tidal.orchestrator.advantage import combine_rewards
from tidal.orchestrator.groups import draw_prompts
from tidal.orchestrator.scoring import Scorer, TrainerState

CHAT = [{"role": "user", "content": "What is (1 + 2) * 4?"}]


def dataset_env(tmp_path, rows: list[dict[str, Any]]):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return make_env("dataset", {"path": str(path)})


def comps(*texts: str) -> list[Completion]:
    return [Completion(list(range(len(t.split()))), [0.0] * len(t.split()), t, "stop") for t in texts]


def scorer(env, funcs, weights=None, **cfg) -> Scorer:
    extra = [(f.__name__ if f.__name__ != "<lambda>" else f"f{i}", f, 1.0 if weights is None else weights[i])
             for i, f in enumerate(funcs)]
    return Scorer({"data": env}, OrchConfig.model_validate(cfg), extra)


# --- reward functions written from TRL's contract ---------------------------------------------------------------
def reward_len(completions, **kwargs):
    """Standard format: completions are strings."""
    return [float(len(c)) for c in completions]


def reward_token_count(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def format_reward(completions, **kwargs):
    """Conversational format: each completion is a list with one assistant message."""
    return [1.0 if re.match(r"^<think>.*?</think><answer>.*?</answer>$", c[0]["content"]) else 0.0
            for c in completions]


def boxed_accuracy(completions, ground_truth, **kwargs):
    found = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
    return [1.0 if m and m.group(1) == gt else 0.0 for m, gt in zip(found, ground_truth, strict=True)]


def math_only(prompts, completions, task, **kwargs):
    return [1.0 if t == "math" else None for t in task]


def test_standard_prompts_give_string_completions_and_every_column(tmp_path):
    env = dataset_env(tmp_path, [{"prompt": "Solve 2x = 4.", "ground_truth": "2", "task": "math", "level": 3}])
    seen: dict[str, Any] = {}

    def spy(prompts, completions, completion_ids, trainer_state, log_metric, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, state=trainer_state, kw=kwargs,
                    log_metric=log_metric)
        return [0.0] * len(completions)

    ex = env.sample(random.Random(0))
    s = scorer(env, [spy, reward_len, reward_token_count, boxed_accuracy], max_steps=9)
    out = s.score(ex, comps(r"so \boxed{2}", r"\boxed{3}"), step=4)
    assert seen["prompts"] == ["Solve 2x = 4."] * 2
    assert seen["completions"] == [r"so \boxed{2}", r"\boxed{3}"]
    assert seen["ids"] == [[0, 1], [0]]
    assert seen["kw"] == {"ground_truth": ["2", "2"], "task": ["math", "math"], "level": [3, 3]}
    assert callable(seen["log_metric"])
    state = seen["state"]
    assert isinstance(state, TrainerState) and state.global_step == 4 and state["max_steps"] == 9
    with pytest.raises(AttributeError, match="no 'epoch'"):
        _ = state.epoch
    assert s.names == ["spy", "reward_len", "reward_token_count", "boxed_accuracy"]  # no env column: no env reward
    np.testing.assert_array_equal(out, [[0, 12, 2, 1], [0, 9, 1, 0]])


def test_conversational_prompts_give_message_completions(tmp_path):
    env = dataset_env(tmp_path, [{"prompt": CHAT, "solution": "12"}])
    ex = env.sample(random.Random(0))
    good = "<think>3 times 4</think><answer>12</answer>"
    seen = []
    s = scorer(env, [format_reward, lambda prompts, completions, solution, **kw: seen.append(
        (prompts, completions, solution)) or [1.0] * len(completions)])
    out = s.score(ex, comps(good, "12"), step=1)
    np.testing.assert_array_equal(out, [[1, 1], [0, 1]])
    prompts, completions, solution = seen[0]
    assert prompts == [CHAT, CHAT] and solution == ["12", "12"]
    assert completions == [[{"role": "assistant", "content": good}], [{"role": "assistant", "content": "12"}]]


def test_none_skips_a_function_for_a_sample_and_weights_apply(tmp_path):
    env = dataset_env(tmp_path, [{"prompt": "2+2?", "task": "math"}, {"prompt": "write code", "task": "code"}])
    s = scorer(env, [math_only, lambda completions, **kw: [0.5] * len(completions)], weights=[2.0, 3.0])
    math_ex, code_ex = env.eval_examples() or []
    per = np.concatenate([s.score(math_ex, comps("4"), 1), s.score(code_ex, comps("def f(): pass"), 1)])
    assert per[0, 0] == 1.0 and math.isnan(per[1, 0])
    total, unscored = combine_rewards(per, s.weights)
    np.testing.assert_allclose(total, [2.0 * 1 + 3.0 * 0.5, 3.0 * 0.5])  # None contributes nothing
    assert unscored == 0


def test_async_reward_functions_are_awaited(tmp_path):
    env = dataset_env(tmp_path, [{"prompt": "p"}])

    async def slow_len(completions, **kwargs):
        await asyncio.sleep(0.01)
        return [float(len(c)) for c in completions]

    out = scorer(env, [slow_len]).score(env.sample(random.Random(0)), comps("abc", "de"), 1)
    np.testing.assert_array_equal(out, [[3.0], [2.0]])


def test_async_reward_functions_run_concurrently_and_sync_ones_in_order(tmp_path):
    env = dataset_env(tmp_path, [{"prompt": "p"}])
    order: list[str] = []

    async def slow_a(completions, **kwargs):
        await asyncio.sleep(0.4)
        return [1.0] * len(completions)

    async def slow_b(completions, **kwargs):
        await asyncio.sleep(0.4)
        return [2.0] * len(completions)

    def first(completions, **kwargs):
        order.append("first")
        return [3.0] * len(completions)

    def second(completions, **kwargs):
        order.append("second")
        return [4.0] * len(completions)

    s = scorer(env, [slow_a, first, slow_b, second])
    t0 = time.monotonic()
    out = s.score(env.sample(random.Random(0)), comps("x"), 1)
    assert time.monotonic() - t0 < 0.75, "the two async functions were awaited together"
    np.testing.assert_array_equal(out, [[1.0, 3.0, 2.0, 4.0]])
    assert order == ["first", "second"]


def test_closures_keep_their_state_in_process(tmp_path):
    env = dataset_env(tmp_path, [{"prompt": "p"}])
    calls: list[int] = []

    def counting(completions, **kwargs):
        calls.append(len(completions))
        return [float(len(calls))] * len(completions)

    s = scorer(env, [counting])
    ex = env.sample(random.Random(0))
    s.score(ex, comps("a", "b", "c"), 1)
    assert s.score(ex, comps("a"), 2)[0, 0] == 2.0 and calls == [3, 1]


def test_a_failing_or_wrong_length_function_scores_the_default_and_is_counted(tmp_path):
    env = dataset_env(tmp_path, [{"prompt": "p"}])
    s = scorer(env, [lambda completions, **kw: [1.0], lambda **kw: 1 / 0], reward_default=-1.0)
    out = s.score(env.sample(random.Random(0)), comps("a", "b"), 1)
    np.testing.assert_array_equal(out, [[-1, -1], [-1, -1]])
    assert s.take_error_counts() == {"reward/f0/errors": 2.0, "reward/f1/errors": 2.0, "reward/errors": 4.0}


def test_built_in_environments_keep_their_reward_and_conversational_calls():
    env = make_env("reverse-text", {})
    ex = env.sample(random.Random(0))
    seen = []
    s = Scorer(env, OrchConfig(), [("spy", lambda completions, answer, task, text, **kw: seen.append(
        (completions, answer, text)) or [0.0] * len(completions), 1.0)])
    out = s.score(ex, comps("<reversed_text>x</reversed_text>"), 1)
    assert s.names == ["reverse-text", "spy"] and out.shape == (1, 2)
    assert seen == [([[{"role": "assistant", "content": "<reversed_text>x</reversed_text>"}]], [ex.answer],
                     [ex.info["text"]])]


def test_an_environment_without_reward_needs_reward_functions(tmp_path):
    env = dataset_env(tmp_path, [{"prompt": "p"}])
    with pytest.raises(ValueError, match=r"nothing scores the completions.*'dataset'.*reward_funcs"):
        Scorer({"data": env}, OrchConfig())


def test_evaluation_scores_a_dataset_env_with_the_reward_functions(tmp_path):
    env = dataset_env(tmp_path, [{"prompt": "p", "ground_truth": "1"}])
    s = scorer(env, [reward_len, boxed_accuracy], weights=[0.5, 10.0])
    total = s.funcs_total(env, env.sample(random.Random(0)), comps(r"\boxed{1}", "no"), 3)
    np.testing.assert_allclose(total, [0.5 * 9 + 10.0, 0.5 * 2])


# --- prompt rendering: standard as plain text, conversational with the chat template ----------------------------
@pytest.fixture(scope="module")
def tokenize_server():
    """A stand-in for vLLM's /tokenize: chat requests are marked so the test can tell the two paths apart."""
    requests: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            return

        def do_POST(self) -> None:  # noqa: N802
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append(req)
            if "messages" in req:
                ids = [999] + [len(m["content"]) for m in req["messages"]]
            else:
                ids = [ord(ch) for ch in req["prompt"]]
                if req["add_special_tokens"]:  # a tokenizer that frames a text with BOS 1 ... EOS 2
                    ids = [1, *ids, 2]
            data = json.dumps({"tokens": ids}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1", requests
    srv.shutdown()


def test_standard_prompts_are_tokenized_as_plain_text(tmp_path, tokenize_server):
    url, requests = tokenize_server
    (tmp_path / "std").mkdir(), (tmp_path / "chat").mkdir()
    # one dataset per format: a column mixing strings and message lists is no valid dataset (datasets' json
    # loader refuses it: "Column(/prompt) changed from string to array")
    envs = [dataset_env(tmp_path / "std", [{"prompt": "abc"}]), dataset_env(tmp_path / "chat", [{"prompt": CHAT}])]

    async def go() -> list[list[int]]:
        client = VllmClient(ClientSection(base_url=[url]))
        try:
            return [p for env in envs
                    for p in (await draw_prompts(env, random.Random(0), client, "m", 3, OrchConfig(), {}))[1]]
        finally:
            await client.close()

    requests.clear()
    prompts = asyncio.run(go())
    assert {tuple(p) for p in prompts} == {(1, 97, 98, 99), (999, len(CHAT[0]["content"]))}  # BOS kept, EOS not
    plain = [r for r in requests if "prompt" in r]
    chat = [r for r in requests if "messages" in r]
    assert plain and chat
    assert {r["add_special_tokens"] for r in plain} == {False, True} and all(r["prompt"] == "abc" for r in plain)
    assert all(r["add_generation_prompt"] is True and r["messages"] == CHAT for r in chat)


def test_log_metric_reports_the_steps_mean_and_keeps_built_in_names(tmp_path):
    env = dataset_env(tmp_path, [{"prompt": "p"}])

    def with_metrics(completions, log_metric, **kwargs):
        log_metric("my/len", float(len(completions[0])))
        log_metric("loss", 123.0)  # a built-in metric's name: dropped
        return [0.0] * len(completions)

    s = scorer(env, [with_metrics])
    ex = env.sample(random.Random(0))
    s.score(ex, comps("ab"), 1)
    s.score(ex, comps("abcd"), 1)
    assert s.take_logged_metrics({"loss"}) == {"my/len": 3.0}
    assert s.take_logged_metrics() == {}


def test_the_code_reward_takes_standard_and_conversational_completions():
    from tidal.rewards.code_exec import unit_tests

    code = "```python\ndef f():\n    return 1\n```"
    tests = ["assert f() == 1", "assert f() == 2"]
    assert unit_tests([code, code], tests=tests) == [1.0, 0.0]
    assert unit_tests([[{"role": "assistant", "content": code}]], tests=tests[:1]) == [1.0]
