"""Stitching sessions into one group's rollouts (`tidal.orchestrator.agentloop.stitch`) and the extend rule of a row
(`tidal.envs.agent.session.Row.extends`), on hand-built rows: the group's prompt is the rows' common prefix, each
row's own rest of prompt is context (mask 0, logprob 0) before its tokens, failed sessions carry `env_error`."""

from __future__ import annotations

from tidal.envs.agent.session import Row, Session
from tidal.orchestrator.agentloop import common_prefix, stitch

A = {"role": "assistant", "content": "x", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}


def session(sid: str, prompt: list[int], ids: list[int], mask: list[int], failure: str | None = None) -> Session:
    s = Session(sid, {}, 4, None, 64)
    if prompt:
        s.rows.append(Row(prompt, [], None, ids=ids, logprobs=[-0.5 if m else 0.0 for m in mask], mask=mask,
                          versions=[None] * len(ids)))
    s.failure, s.last_answer = failure, f"answer {sid}"
    return s


def test_group_prompt_is_the_common_prefix_and_the_rest_is_context():
    a = session("a", [1, 2, 3, 4], [7, 8], [1, 1])
    b = session("b", [1, 2, 5], [9, 10, 11], [1, 0, 1])
    c = session("c", [], [], [], failure="the program exited with code 1")
    out = stitch([a, b, c], [1, 2, 3, 4])
    assert [o.prompt_ids for o in out] == [[1, 2]] * 3
    assert out[0].token_ids == [3, 4, 7, 8] and out[0].mask == [0, 0, 1, 1]
    assert out[0].logprobs == [0.0, 0.0, -0.5, -0.5]
    assert out[1].token_ids == [5, 9, 10, 11] and out[1].mask == [0, 1, 0, 1]
    assert out[0].text == "answer a" and out[0].env_error is None
    assert out[2].token_ids == [] and "exited with code 1" in (out[2].env_error or "")
    assert common_prefix([[1, 2], [1, 2, 3]]) == [1, 2]


def test_a_row_extends_only_with_its_history_and_tools_and_after_an_end_of_turn():
    row = Row([1], [{"role": "user", "content": "q"}], None, history=[{"role": "user", "content": "q"}, A])
    echo = {**A, "tool_calls": [{**A["tool_calls"][0], "id": "other", "function": {"name": "f",
                                                                                 "arguments": '{ "a":1 }'}}]}
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "r"}
    assert row.extends([{"role": "user", "content": "q"}, echo, tool], None)
    assert not row.extends([{"role": "user", "content": "q"}, echo], None), "nothing new"
    assert not row.extends([{"role": "user", "content": "Q"}, echo, tool], None), "history rewritten"
    assert not row.extends([{"role": "user", "content": "q"}, {**A, "content": "y"}, tool], None)
    assert not row.extends([{"role": "user", "content": "q"}, echo, tool], [{"type": "function"}]), "other tools"
    row.open = False
    assert not row.extends([{"role": "user", "content": "q"}, echo, tool], None), "the turn was cut"
