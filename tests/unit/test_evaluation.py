"""Online evaluation bookkeeping: fixed example sets, when evaluations are due, skips on resume."""

from __future__ import annotations

from tidal.config.orch import OrchConfig
from tidal.monitor.metrics import MetricsWriter
from tidal.orchestrator.evaluation import GENERATED_EVAL_SIZE, Evaluator


def evaluator(tmp_path, **kw) -> Evaluator:
    cfg = OrchConfig.model_validate({"eval": {"env": [{"id": "reverse-text"}], **kw}})
    assert cfg.eval is not None
    return Evaluator(cfg.eval, cfg.sampling, cfg.seq_len, MetricsWriter(tmp_path / "eval.jsonl"))


def test_evaluations_fall_on_the_first_policy_past_each_multiple(tmp_path):
    ev = evaluator(tmp_path, interval=3)
    assert ev.due(0)
    ev.skip(0)
    assert [p for p in (1, 2, 3) if ev.due(p)] == [3]
    ev.skip(3)
    assert not ev.due(3) and not ev.due(5) and ev.due(7)  # 6 was never served: 7 is the first past it
    ev.skip(7)
    assert not ev.due(8) and ev.due(9)


def test_base_model_only_when_asked(tmp_path):
    assert not evaluator(tmp_path, eval_base_model=False).due(0)


def test_eval_examples_are_fixed_and_sized(tmp_path):
    a, b = evaluator(tmp_path, num_examples=5), evaluator(tmp_path, num_examples=5)
    ex_a, ex_b = a.sets["reverse-text"][1], b.sets["reverse-text"][1]
    assert len(ex_a) == 5 and [e.prompt for e in ex_a] == [e.prompt for e in ex_b]
    assert len(evaluator(tmp_path).sets["reverse-text"][1]) == GENERATED_EVAL_SIZE


def test_turns_count_model_turns_after_environment_replies():
    from tidal.orchestrator.evaluation import turns

    assert turns(None) == 1 and turns([1, 1, 1]) == 1
    assert turns([1, 1, 0, 0, 1]) == 2 and turns([1, 0, 1, 0, 0, 1, 1]) == 3
    assert turns([1, 1, 0, 0]) == 1, "a reply the model never answered is no turn"
