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


def forked_session(sid: str, failure: str | None = None) -> Session:
    """Two rows: a fork (its own prompt [1, 9], sampled [20, 21], a spliced tool turn [5], sampled [22]) and the last
    row (prompt [1, 2, 3], sampled [30, 31])."""
    s = Session(sid, {}, 4, None, 64)
    s.rows.append(Row([1, 9], [{"role": "user", "content": "side"}], None, ids=[20, 21, 5, 22],
                      logprobs=[-0.1, -0.2, 0.0, -0.3], mask=[1, 1, 0, 1], versions=[None] * 4,
                      history=[{"role": "user", "content": "side"}, {"role": "assistant", "content": "fork"}]))
    s.rows.append(Row([1, 2, 3], [], None, ids=[30, 31], logprobs=[-0.4, -0.5], mask=[1, 1], versions=[None] * 2))
    s.failure, s.last_answer, s.forks = failure, "final", 1
    return s


def test_a_forked_row_is_trained_with_its_own_prompt_and_the_sessions_reward_and_advantage():
    import numpy as np

    from tidal.config.orch import OrchConfig
    from tidal.orchestrator.assemble import build_batch

    out = stitch([forked_session("a"), session("b", [1, 2, 4], [40], [1])], [1, 2])
    fork = out[0].extra_rows[0]
    assert fork.prompt_ids == [1, 9] and fork.token_ids == [20, 21, 5, 22] and fork.mask == [1, 1, 0, 1]
    assert [t for t, m in zip(fork.token_ids, fork.mask, strict=True) if m] == [20, 21, 22], "its sampled tokens"
    assert fork.logprobs == [-0.1, -0.2, 0.0, -0.3] and fork.text == "fork"
    assert out[1].extra_rows is None
    cfg = OrchConfig(seq_len=64, batch_size=2, rollouts_per_example=2)
    adv = [np.full(len(c.token_ids), v) for c, v in zip(out, (0.7, -0.7), strict=True)]
    batch, metrics = build_batch(1, [out[0].prompt_ids], [out], np.array([1.0, 0.0]), adv, 3, cfg)
    rows = [batch.tokens[s].tolist() for s in batch.samples()]
    assert rows == [[1, 2, 3, 30, 31], [1, 9, 20, 21, 5, 22], [1, 2, 4, 40]], "main row, its fork, the next rollout"
    assert metrics["samples"] == 3
    fork_slice = batch.samples()[1]
    assert batch.loss_mask[fork_slice].tolist() == [0, 0, 1, 1, 0, 1]
    np.testing.assert_allclose(batch.inference_logprobs[fork_slice], [0, 0, -0.1, -0.2, 0.0, -0.3], atol=1e-7)
    np.testing.assert_allclose(batch.advantages[fork_slice], [0, 0, 0.7, 0.7, 0.7, 0.7], atol=1e-7)
    assert batch.rewards.tolist() == [1.0, 1.0, 0.0] and batch.policy_steps.tolist() == [3, 3, 3]
    masked, _ = build_batch(1, [out[0].prompt_ids], [out], np.array([1.0, 0.0]), adv, 3, cfg,
                            masked=np.array([True, False]))
    assert masked.loss_mask[masked.samples()[1]].sum() == 0, "a rollout masked out masks its forks too"


def test_forks_are_left_out_with_train_forks_false_and_for_a_failed_session():
    assert stitch([forked_session("a")], [1], train_forks=False)[0].extra_rows is None
    failed = stitch([forked_session("a", failure="the program exited with code 1")], [1])[0]
    assert failed.extra_rows is None and failed.env_error


def test_a_teacher_scores_every_training_row_in_the_batchs_order():
    import asyncio

    import numpy as np

    from tidal.config.orch import TeacherSection
    from tidal.orchestrator.groups import Collected, teacher_logprobs

    class Teacher:
        async def prompt_logprobs_many(self, model, seqs, concurrency):
            return [[float(len(s))] * len(s) for s in seqs]

    out = stitch([forked_session("a"), session("b", [1, 2, 4], [40], [1])], [1, 2])
    got = Collected()
    got.add(None, out[0].prompt_ids, out, np.zeros((2, 0)))
    seqs = asyncio.run(teacher_logprobs(Teacher(), TeacherSection(model="t"), got))
    assert [len(s) for s in seqs] == [5, 6, 4]
