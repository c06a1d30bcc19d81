"""A rollout function's output (`tidal.orchestrator.rollout_func.completions_of`): TRL's keys become Completions as
returned, and every malformed output is refused naming the key (the server-backed path:
tests/integration/test_rollout_func.py)."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from tidal.models.sources import resolve_model
from tidal.orchestrator.rollout_func import completions_of

N, SEQ_LEN, BUDGET = 3, 64, 8


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_model("tidal:tiny-reverse"))


def output(seed: int = 0) -> dict:
    rng = random.Random(seed)
    prompt = [rng.randrange(100, 200) for _ in range(5)]
    ids = [[rng.randrange(100, 200) for _ in range(rng.randrange(1, BUDGET))] for _ in range(N)]
    return {"prompt_ids": [prompt] * N, "completion_ids": ids,
            "logprobs": [[-rng.random() * 3 for _ in c] for c in ids]}


def test_tokens_logprobs_fields_and_trl_top1_shape_kept_as_returned(tok):
    out = output(1)
    top1 = {**out, "logprobs": [[[lp, -9.0] for lp in row] for row in out["logprobs"]],
            "logprob_token_ids": [[[t, 7] for t in c] for c in out["completion_ids"]],
            "score": [0.5, 1.5, 2.5], "tag": "x"}
    for given in (out, top1):
        comps = completions_of(given, N, SEQ_LEN, BUDGET, tok)
        assert [c.token_ids for c in comps] == out["completion_ids"]
        assert [c.logprobs for c in comps] == out["logprobs"]
        assert all(c.prompt_ids == out["prompt_ids"][0] and c.mask is None for c in comps)
        assert [c.text for c in comps] == [tok.decode(c, skip_special_tokens=True) for c in out["completion_ids"]]
    assert [c.fields for c in comps] == [{"score": s, "tag": "x"} for s in (0.5, 1.5, 2.5)]


def test_finish_reason_from_eos_and_budget(tok):
    out = output(2)
    out["completion_ids"] = [[150] * BUDGET, [150] * (BUDGET - 1) + [tok.eos_token_id], [150, 151]]
    out["logprobs"] = [[-1.0] * len(c) for c in out["completion_ids"]]
    assert [c.finish_reason for c in completions_of(out, N, SEQ_LEN, BUDGET, tok)] == ["length", "stop", "stop"]


@pytest.mark.parametrize(("change", "error"), [
    (lambda o: [1, 2], r"must return a dict with \['prompt_ids', 'completion_ids', 'logprobs'\], got a list"),
    (lambda o: {k: v for k, v in o.items() if k != "prompt_ids"}, r"must return keys \['prompt_ids'\]"),
    (lambda o: {**o, "prompt_ids": [o["prompt_ids"][0], [1], [1]]}, r"'prompt_ids' differ within one group"),
    (lambda o: {**o, "completion_ids": [["a"]] * N}, r"'completion_ids'\[0\] must be a list of token ids"),
    (lambda o: {**o, "logprobs": [[0.5] * len(c) for c in o["completion_ids"]]},
     r"'logprobs'\[0\] holds 0.5: each must be a finite log probability"),
    (lambda o: {**o, "logprobs": [[float("nan")] * len(c) for c in o["completion_ids"]]}, r"'logprobs'\[0\] holds nan"),
    (lambda o: {**o, "logprob_token_ids": [[[9]] * len(c) for c in o["completion_ids"]]},
     r"'logprob_token_ids'\[0\] does not start each position with the sampled token"),
    (lambda o: {**o, "env_mask": [[2] * len(c) for c in o["completion_ids"]]}, r"'env_mask'\[0\] must be \d+ values"),
    (lambda o: {**o, "score": [1.0]}, r"'score' has 1 rows, expected a list of 3"),
    (lambda o: {**o, "prompt_ids": [list(range(SEQ_LEN))] * N}, r"are 64 \+ \d+ tokens, over seq_len 64"),
])
def test_malformed_output_is_refused_naming_the_key(tok, change, error):
    with pytest.raises((ValueError, TypeError), match=error):
        completions_of(change(output(3)), N, SEQ_LEN, BUDGET, tok)
