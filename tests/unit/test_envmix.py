"""Several environments in one run: `buffer.env_ratios` kept over 1,000 examples, scoring routed to each
example's environment, counters restored on resume, config checks."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from tidal.config.orch import OrchConfig
from tidal.inference.protocol import Completion
from tidal.orchestrator.ckpt import resume_orch, save_orch
from tidal.orchestrator.envmix import EnvMix
from tidal.orchestrator.scoring import Scorer
from tidal.orchestrator.stats import rollout_metrics

TWO = [{"id": "reverse-text", "name": "short", "args": {"min_len": 2, "max_len": 5}},
       {"id": "reverse-text", "name": "long", "args": {"min_len": 30, "max_len": 40}}]


@pytest.mark.parametrize("ratios", [[3.0, 1.0], [0.5, 0.5], [0.1, 0.9]])
def test_env_ratios_hold_over_1000_examples(ratios):
    mix = EnvMix(OrchConfig.model_validate({"env": TWO}).env, ratios)
    rng = random.Random(7)
    examples = [mix.sample(rng) for _ in range(1000)]
    share = np.mean([ex.task == "short" for ex in examples])
    want = ratios[0] / sum(ratios)
    assert abs(share - want) <= 0.05 * want + 1e-9, (share, want)
    # each example really comes from its environment
    for ex in examples[:50]:
        text = ex.prompt[-1]["content"]
        assert (len(text) <= 12) == (ex.task == "short"), (ex.task, text)


def test_random_ratios_of_three_environments():
    rnd = random.Random(3)
    ratios = [rnd.uniform(0.05, 1) for _ in range(3)]
    envs = [*TWO, {"id": "reverse-text", "name": "mid"}]
    mix = EnvMix(OrchConfig.model_validate({"env": envs}).env, ratios)
    tasks = [mix.sample(random.Random(i)).task for i in range(1000)]
    for name, r in zip(("short", "long", "mid"), ratios, strict=True):
        assert abs(tasks.count(name) / 1000 - r / sum(ratios)) <= 0.05 * r / sum(ratios)


def test_scoring_goes_to_the_examples_environment():
    cfg = OrchConfig.model_validate({"env": TWO, "rollouts_per_example": 2, "batch_size": 4})
    mix = EnvMix(cfg.env, cfg.buffer.env_ratios)
    scorer = Scorer(mix.envs, cfg)
    rng = random.Random(0)
    ex_short, ex_long = mix.sample(rng), mix.sample(rng)
    assert {ex_short.task, ex_long.task} == {"short", "long"}
    if ex_short.task == "long":
        ex_short, ex_long = ex_long, ex_short
    right = f"<reversed_text>{ex_short.answer}</reversed_text>"
    comps = [Completion([1], [0.0], right, "stop"), Completion([1], [0.0], "nothing", "stop")]
    a = scorer.score(ex_short, comps, 1)
    b = scorer.score(ex_long, comps, 1)
    assert scorer.names == ["short", "long"]
    assert a[0, 0] == pytest.approx(mix.envs["short"].reward(ex_short, right)) and math.isnan(a[0, 1])
    assert math.isnan(b[0, 0]) and b[1, 1] == 0.0
    per_func = np.concatenate([a, b])
    m = rollout_metrics(np.nansum(per_func, axis=1), per_func, scorer.names, np.ones(4), np.zeros(4, bool), 2)
    assert m["reward/short/mean"] == pytest.approx(np.mean(a[:, 0]))  # over its own examples only
    assert m["reward/long/mean"] == pytest.approx(np.mean(b[:, 1]))


def test_mix_counters_are_checkpointed(tmp_path):
    cfg = OrchConfig.model_validate({"env": TWO, "buffer": {"env_ratios": [2, 1]}, "ckpt": {"interval": 1}})
    mix, rng = EnvMix(cfg.env, cfg.buffer.env_ratios), random.Random(1)
    for _ in range(7):
        mix.sample(rng)
    from tidal.orchestrator.ckpt import Progress

    save_orch(tmp_path, Progress(step=1), rng, cfg.ckpt, mix)
    expected = [mix.sample(rng).task for _ in range(9)]
    cfg.ckpt.resume_step = -1
    again, rng2 = EnvMix(cfg.env, cfg.buffer.env_ratios), random.Random(99)
    resume_orch(tmp_path, cfg.ckpt, rng2, again)
    assert [again.sample(rng2).task for _ in range(9)] == expected


@pytest.mark.parametrize("update,match", [
    ({"env": TWO, "buffer": {"env_ratios": [1.0]}}, "one non-negative ratio per env"),
    ({"env": TWO, "buffer": {"env_ratios": [0, 0]}}, "summing to more than 0"),
    ({"env": [{"id": "reverse-text"}, {"id": "reverse-text"}]}, "names must be unique"),
    ({"env": []}, "at least one environment"),
])
def test_bad_environment_lists_are_refused(update, match):
    with pytest.raises(ValueError, match=match):
        OrchConfig.model_validate(update)
