"""The agent endpoint on a real vLLM server, with the real `openai` and `anthropic` SDKs as clients (no network).

The model is `tests.e2e.agent_env.calling_tool_model` (the bundled model writing Hermes tool calls that parse); each
group runs the programs of `tests.e2e.agent_env` through `agent_group`, as the orchestrator samples a batch."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import httpx
import numpy as np
import pytest

from tidal.config.orch import ClientSection, OrchConfig
from tidal.envs import make_env
from tidal.envs.base import Example
from tidal.envs.splice import splice_after
from tidal.inference.backends.vllm.client import VllmClient
from tidal.inference.protocol import server_root
from tidal.orchestrator.agentloop import agent_group
from tidal.orchestrator.assemble import build_batch
from tidal.orchestrator.outage import judged, keeps_group

pytestmark = pytest.mark.vllm

N = 2
CFG = OrchConfig(seq_len=512, batch_size=N, rollouts_per_example=N, sampling={"max_tokens": 48, "seed": 11})
EXAMPLE = Example(prompt=[{"role": "system", "content": "Reverse the text inside the tags."},
                          {"role": "user", "content": "hello"}], answer="olleh", info={"text": "hello"})


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory):
    """A real vLLM server on `calling_tool_model`; yields (base URL, model name)."""
    from tests.conftest import free_port, kill_group, tidal, wait_healthy
    from tests.e2e.agent_env import calling_tool_model

    model = calling_tool_model(tmp_path_factory.mktemp("agent") / "model")
    port, log = free_port(), tmp_path_factory.mktemp("vllm_agent") / "infer.log"
    with open(log, "w") as f:
        proc = tidal("grpo-infer", "--infer.model", str(model), "--infer.port", str(port), stdout=f)
        try:
            wait_healthy(port, proc)
        except Exception:
            kill_group(proc)
            raise RuntimeError(log.read_text()[-3000:]) from None
        yield f"http://127.0.0.1:{port}/v1", str(model)
        kill_group(proc)


def run_group(server: tuple[str, str], example: Example = EXAMPLE, groups: int = 1, **args: Any
              ) -> tuple[Any, list[Any]]:
    """`groups` groups of `example` (one environment) run by the program in `args` (the agent env's args), through
    `agent_group`; the last group's rollouts."""
    url, model = server
    env = make_env("agent", {"task": {"id": "reverse-text"}, "tool_prompt": "program", **args})
    # tool_prompt program: the model writes its calls untold, and its template (like SmolLM2's) ignores tools=

    async def go() -> list[Any]:
        client = VllmClient(ClientSection(base_url=[url]))
        try:
            await client.wait_ready()
            prompt = await client.tokenize_prompt(model, example.prompt)
            try:
                got: list[Any] = []
                for _ in range(groups):
                    got = await agent_group(client, model, prompt, N, CFG.sampling, CFG.seq_len, CFG.sampling.seed,
                                            1.0, env, example)
                return got
            finally:
                await env.server.stop()
        finally:
            await client.close()

    return env, asyncio.run(go())


def tokenize(server: tuple[str, str], messages: list[dict[str, Any]], gen: bool) -> list[int]:
    url, model = server
    from tests.e2e.agent_env import TOOLS

    r = httpx.post(f"{server_root(url)}/tokenize", json={"model": model, "messages": messages, "tools": TOOLS,
                                                         "add_generation_prompt": gen, "add_special_tokens": False})
    r.raise_for_status()
    return list(r.json()["tokens"])


def check_spliced(server: tuple[str, str], session: Any) -> None:
    """Every extending call's prompt is the previous prompt + completion + the splice rule's suffix, computed here
    from independent renderings of the conversation without and with the new messages."""
    log = session.log
    for prev, call in zip(log, log[1:], strict=False):
        assert call.extended
        history = call.messages[:len(prev.messages) + 1]
        before = tokenize(server, history, False)
        after = tokenize(server, call.messages, True)
        suffix = splice_after(before, after, prev.token_ids[-1])
        assert call.prompt_ids == prev.prompt_ids + prev.token_ids + suffix


def check_row(c: Any, session: Any) -> None:
    """The trained row: the calls' model tokens with mask 1, everything spliced with mask 0 and logprob 0."""
    row = session.rows[-1]
    mask = np.array(c.mask)
    first = session.log[0]
    model_tokens = [t for k, rec in enumerate(session.log) for t in rec.token_ids]
    assert [t for t, m in zip(c.token_ids, c.mask, strict=True) if m] == model_tokens
    assert c.prompt_ids + c.token_ids == first.prompt_ids + row.ids
    assert all(lp == 0.0 for lp, m in zip(c.logprobs, mask, strict=True) if not m)
    assert all(lp <= 0.0 for lp in c.logprobs)


def test_three_turn_tool_sessions_are_one_row_spliced_by_the_rule(agent_server):
    env, comps = run_group(agent_server, function="tests.e2e.agent_env:openai_program")
    assert len(comps) == N
    for c in comps:
        s = c.environment
        assert c.env_error is None, c.env_error
        assert s.calls == 3 and s.forks == 0 and len(s.rows) == 1
        check_spliced(agent_server, s)
        check_row(c, s)
    tool_msgs = [m for c in comps for m in c.messages if m["role"] == "tool"]
    assert tool_msgs, "the model called the tool; its results went back as tool messages"
    calls = [m for c in comps for m in c.messages if m.get("tool_calls")]
    assert calls and all(m["tool_calls"][0]["function"]["name"] == "reverse" for m in calls)
    metrics = env.take_metrics()
    assert metrics["agent/calls"] == 3 * N and metrics["agent/forks"] == 0 and metrics["agent/rows"] == N
    assert env.take_metrics()["agent/calls"] == 0, "counters reset once taken"


@pytest.mark.parametrize(("plain", "streaming"), [
    ("openai_program", "streaming_program"),
    ("untooled_program", "untooled_streaming_program"),
    ("anthropic_program", "anthropic_streaming_program"),
    ("anthropic_untooled_program", "anthropic_untooled_streaming_program"),
])
def test_streaming_and_non_streaming_give_the_same_row(agent_server, plain, streaming):
    """Through the real SDKs (stream=True): the same rows as the plain answers; without tools (the model's text is
    all content) each turn's text arrives token by token (several deltas a call)."""
    from tests.e2e import agent_env

    _, a_rows = run_group(agent_server, function=f"tests.e2e.agent_env:{plain}")
    agent_env.DELTAS.clear()
    _, b_rows = run_group(agent_server, function=f"tests.e2e.agent_env:{streaming}")
    assert len(agent_env.DELTAS) == 3 * N, agent_env.DELTAS
    if "untooled" in plain:
        assert min(agent_env.DELTAS) > 1, f"text deltas per streamed call: {agent_env.DELTAS}"
    for a, b in zip(a_rows, b_rows, strict=True):
        assert b.env_error is None, b.env_error
        assert a.environment.calls == b.environment.calls == 3
        assert b.environment.forks == 0, "every streamed answer, echoed back, extended the row"
        assert a.prompt_ids == b.prompt_ids and a.token_ids == b.token_ids and a.mask == b.mask
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert a.messages is not None and b.messages is not None
        assert [m["role"] for m in a.messages] == [m["role"] for m in b.messages]
        assert [m.get("content") for m in a.messages] == [m.get("content") for m in b.messages]


def test_anthropic_sdk_session_with_tool_use_is_one_spliced_row(agent_server):
    _, comps = run_group(agent_server, function="tests.e2e.agent_env:anthropic_program")
    for c in comps:
        s = c.environment
        assert c.env_error is None, c.env_error
        assert s.calls == 3 and s.forks == 0 and len(s.rows) == 1
        check_spliced(agent_server, s)
        check_row(c, s)
    assert any(m["role"] == "tool" for c in comps for m in c.messages), "tool_result blocks became tool messages"


def test_command_program_gets_the_sdk_environment(agent_server):
    _, comps = run_group(agent_server, command=[sys.executable, "-m", "tests.e2e.agent_env"])
    for c in comps:
        assert c.env_error is None, c.env_error
        assert c.environment.calls == 3 and len(c.environment.rows) == 1
        check_row(c, c.environment)


def test_a_rewritten_history_forks_and_is_counted(agent_server):
    env, comps = run_group(agent_server, function="tests.e2e.agent_env:forking_program")
    for c in comps:
        s = c.environment
        assert c.env_error is None, c.env_error
        assert s.calls == 3 and s.forks == 1 and len(s.rows) == 2
        assert not s.log[2].extended
        assert s.rows[-1].prompt_ids == s.log[2].prompt_ids, "the fork's row starts from its own rendering"
        check_row_of_fork = c.prompt_ids + c.token_ids
        assert check_row_of_fork == s.log[2].prompt_ids + s.log[2].token_ids
        fork = c.extra_rows[0]  # the first two calls' row, forked off: trained too, its own prompt
        assert fork.prompt_ids == s.log[0].prompt_ids
        assert fork.prompt_ids + fork.token_ids == s.log[1].prompt_ids + s.log[1].token_ids
        assert [t for t, m in zip(fork.token_ids, fork.mask, strict=True) if m] == s.log[0].token_ids + \
            s.log[1].token_ids, "exactly its sampled tokens carry mask 1"
    batch, _ = build_batch(1, [comps[0].prompt_ids], [comps], np.zeros(N), [np.ones(len(c.token_ids))
                                                                             for c in comps], 0, CFG)
    assert batch.num_samples == 2 * N and int(batch.loss_mask.sum()) == sum(
        len(r.token_ids) for c in comps for r in c.environment.log), "every sampled token of both rows is trained"
    assert env.score_rollouts(EXAMPLE, comps) == [0.25] * N, "reward auto: the program's returned reward"
    m = env.take_metrics()
    assert m["agent/forks"] == N and m["agent/rows"] == 2 * N and m["agent/calls"] == 3 * N


def test_crashing_and_hanging_programs_train_nothing(agent_server, tmp_path):
    from tidal.envs.agent.env import BROKEN_AFTER

    env, crashed = run_group(agent_server, function="tests.e2e.agent_env:crashing_program",
                             groups=BROKEN_AFTER // N)  # a broken program's count: these called first
    assert env.take_metrics()["agent/failures"] == BROKEN_AFTER // N * N, "episodes failed, the run went on"
    assert all("RuntimeError: the agent crashed" in (c.env_error or "") for c in crashed)
    ok = judged(crashed)
    assert not ok.any() and not keeps_group(ok), "failed episodes are not judged: the group is dropped"
    batch, _ = build_batch(1, [crashed[0].prompt_ids], [crashed], np.zeros(N), [np.ones(len(c.token_ids))
                                                                            for c in crashed], 0, CFG, masked=~ok)
    assert batch.loss_mask.sum() == 0, "nothing of a failed episode is trained"
    pid_file = tmp_path / "pids"
    hang = (f"import os, time; open({str(pid_file)!r}, 'a').write(str(os.getpid()) + '\\n'); "
            f"os.system('sleep 120 &'); time.sleep(120)")
    env, hung = run_group(agent_server, command=[sys.executable, "-c", hang], timeout_s=3)
    assert all("timeout_s=3" in (c.env_error or "") for c in hung)
    assert all(c.token_ids == [] for c in hung), "no call: nothing to train"
    assert not judged(hung).any()
    assert env.take_metrics()["agent/failures"] == N
    for pid in pid_file.read_text().split():
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)
