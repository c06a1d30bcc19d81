"""Advantage options, reward combination, rollout/drift metrics and the mismatch guard: float64 loop
references on fresh random inputs, and hand-checkable cases for every metric."""

from __future__ import annotations

import math
import statistics
import sys
import types

import numpy as np
import pytest
import torch

from tidal.config.orch import OrchConfig
from tidal.config.train import MismatchGuardConfig
from tidal.envs import make_env
from tidal.envs.base import Example
from tidal.inference.protocol import Completion
from tidal.orchestrator.advantage import (
    combine_rewards,
    custom_advantages,
    group_advantages,
    load_function,
    process_advantages,
)
from tidal.orchestrator.scoring import Scorer
from tidal.orchestrator.stats import rollout_metrics
from tidal.trainer.step.health import MismatchError, MismatchGuard
from tidal.trainer.step.loss import LossInputs, LossScale, drift_sums, policy_loss


@pytest.mark.parametrize("scale", ["none", "group", "batch"])
@pytest.mark.parametrize("weighted", [False, True])
def test_group_advantages_against_float64_loop(scale, weighted):
    rng = np.random.default_rng()
    g, n = 6, 7
    rewards = rng.random(g * n).astype(np.float32)
    rewards[:g] = 0.5  # one group with zero variance
    lengths = rng.integers(1, 50, g * n)
    adv = group_advantages(rewards, g, scale, lengths, weighted)
    allr = [float(x) for x in rewards]
    batch_std = statistics.stdev(allr)
    for k in range(n):
        grp = allr[k * g:(k + 1) * g]
        lens = [int(x) for x in lengths[k * g:(k + 1) * g]]
        base = sum(r * ln for r, ln in zip(grp, lens, strict=True)) / sum(lens) if weighted else sum(grp) / g
        div = {"none": 1.0, "group": statistics.stdev(grp) + 1e-4, "batch": batch_std + 1e-4}[scale]
        assert np.allclose(adv[k * g:(k + 1) * g], [(r - base) / div for r in grp], rtol=1e-12, atol=1e-12)
    assert np.all(adv[:g] == 0), "a zero-variance group has no signal"


def test_group_advantages_rejects_ragged_groups():
    with pytest.raises(ValueError, match="groups of 8"):
        group_advantages(np.zeros(12), 8)


def test_process_advantages_against_loop():
    rng = np.random.default_rng()
    g = 4
    lens = [int(x) for x in rng.integers(3, 20, 2 * g)]
    steps = []
    for ln in lens:
        ends = sorted(set(int(x) for x in rng.integers(0, ln, rng.integers(1, 4))))
        steps.append([(e, float(rng.random())) for e in ends])
    out = process_advantages(steps, lens, g)
    for k in range(2):
        pooled = [r for i in range(k * g, (k + 1) * g) for _, r in steps[i]]
        mean, std = sum(pooled) / len(pooled), statistics.stdev(pooled) + 1e-4
        for i in range(k * g, (k + 1) * g):
            want = [sum((r - mean) / std for e, r in steps[i] if e >= t) for t in range(lens[i])]
            assert np.allclose(out[i], want, rtol=1e-12, atol=1e-12)


def test_process_advantages_hand_case():
    # one group of two: steps [(1, 1.0)] and [(0, 0.0), (2, 1.0)] -> pooled 1, 0, 1: mean 2/3, std 0.57735
    out = process_advantages([[(1, 1.0)], [(0, 0.0), (2, 1.0)]], [3, 3], 2)
    s = math.sqrt(1 / 3) + 1e-4
    assert np.allclose(out[0], [(1 / 3) / s, (1 / 3) / s, 0.0])
    assert np.allclose(out[1], [(-2 / 3 + 1 / 3) / s, (1 / 3) / s, (1 / 3) / s])


def test_combine_rewards_weights_and_none():
    per = np.array([[1.0, np.nan, 0.5], [np.nan, np.nan, np.nan], [0.0, 2.0, np.nan]])
    total, unscored = combine_rewards(per, [1.0, 0.5, 2.0])
    assert total.tolist() == [2.0, 0.0, 1.0] and unscored == 1


def _adv_fn(rewards, lengths, group_size, shift=0.0):
    return rewards - rewards.max() + shift


def test_custom_advantage_function(monkeypatch):
    mod = types.ModuleType("tidal_test_adv")
    mod.fn = _adv_fn  # type: ignore[attr-defined]
    mod.bad = lambda rewards, lengths, group_size: np.ones(2)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tidal_test_adv", mod)
    fn = load_function("tidal_test_adv:fn")
    out = custom_advantages(fn, "tidal_test_adv:fn", np.array([0.0, 1.0, 3.0]), np.ones(3), 3, {"shift": 1.0})
    assert out.tolist() == [-2.0, -1.0, 1.0]
    with pytest.raises(ValueError, match="tidal_test_adv:bad returned shape"):
        custom_advantages(load_function("tidal_test_adv.bad"), "tidal_test_adv:bad", np.zeros(3), np.ones(3), 3, {})
    with pytest.raises(ValueError, match="cannot import 'tidal_test_adv:nope'"):
        load_function("tidal_test_adv:nope")
    with pytest.raises(ValueError, match="advantage.type 'custom' needs advantage.import_path"):
        OrchConfig.model_validate({"advantage": {"type": "custom"}})
    with pytest.raises(ValueError, match="apply to advantage.type 'default' only"):
        OrchConfig.model_validate({"advantage": {"type": "process", "scale_rewards": "group"}})


def test_rollout_metrics_hand_case():
    rewards = np.array([1.0, 1.0, 0.0, 0.5])  # groups of 2: [1, 1] has zero std, [0, 0.5] not
    per = np.array([[1.0, np.nan], [1.0, np.nan], [0.0, 2.0], [0.5, 4.0]])
    m = rollout_metrics(rewards, per, ["env", "len"], np.array([10, 4, 6, 8]), np.array([True, False, False, True]), 2)
    assert m["frac_reward_zero_std"] == 0.5
    assert m["reward/mean"] == 0.625 and m["reward/env/mean"] == 0.625
    assert m["reward/len/mean"] == 3.0 and m["reward/len/std"] == 1.0
    assert (m["completions/mean_length"], m["completions/min_length"], m["completions/max_length"]) == (7.0, 4.0, 10.0)
    assert m["completions/clipped_ratio"] == 0.5 and m["completions/mean_terminated_length"] == 5.0


def test_drift_metrics_hand_case():
    tr = torch.tensor([math.log(0.5), math.log(0.2)], dtype=torch.float64)
    inf = torch.tensor([math.log(0.25), math.log(0.4)], dtype=torch.float64)
    s = drift_sums(tr, inf)  # ratios 2 and 0.5
    assert s["token_mult_prob_error"] == pytest.approx(2 + 2)
    assert s["sampling_importance_ratio"] == pytest.approx(2 + 0.5)
    assert s["approx_entropy"] == pytest.approx(-(2 * math.log(0.5) + 0.5 * math.log(0.2)))
    assert s["mismatch_kl"] == pytest.approx((2 - 1 - math.log(2)) + (0.5 - 1 - math.log(0.5)))


def test_loss_metric_sums_hand_case():
    """One sequence of 4 tokens, dapo: ratios to old 0.5, 1, 1.5, 1 with advantages -1, 1, 1, -1 and
    epsilon 0.2 -> token 0 clipped low, token 2 clipped high; entropies 0..3 with rho 0.5 keep tokens 2, 3."""
    from tidal.config.train import LossConfig

    lp = torch.log(torch.tensor([[0.5, 0.4, 0.3, 0.2]], dtype=torch.float64))
    old = lp - torch.log(torch.tensor([[0.5, 1.0, 1.5, 1.0]], dtype=torch.float64))
    x = LossInputs(lp, old, lp.clone(), torch.tensor([[-1.0, 1.0, 1.0, -1.0]], dtype=torch.float64),
                   torch.ones(1, 4, dtype=torch.bool), torch.zeros(1, 4, dtype=torch.long),
                   ref_logprobs=lp + math.log(2), entropy=torch.tensor([[0.0, 1.0, 2.0, 3.0]], dtype=torch.float64))
    cfg = LossConfig(loss_type="dapo", top_entropy_quantile=0.5, beta=0.1)
    _, s = policy_loss(x, cfg, LossScale(4, 1, 1, 4))
    assert s["clip_ratio/low_mean"] == 1 and s["clip_ratio/high_mean"] == 1 and s["clip_ratio/region_mean"] == 2
    assert s["masked/entropy"] == 2 and s["masked"] == 2 and s["entropy"] == 6.0
    assert s["kl"] == pytest.approx(4 * (2 - math.log(2) - 1))  # k3 with ref/pi = 2 on every token
    cfg = LossConfig(token_mask_high=1.2)  # aipo: inference = lp / 2 on token 3 -> ratio 2 masked
    x.inference_logprobs = lp.clone()
    x.inference_logprobs[0, 3] -= math.log(2)
    _, s = policy_loss(x, cfg, LossScale(4, 1, 1, 4))
    assert s["masked/token_high"] == 1 and s["masked"] == 1 and s["masked/token_low"] == 0


def test_mismatch_guard_warns_after_patience_then_rearms():
    guard = MismatchGuard(MismatchGuardConfig(patience=2, max_mismatch_kl=0.01))
    high, low = {"mismatch_kl": 0.05, "token_mult_prob_error": 1.0}, {"mismatch_kl": 0.0}
    assert guard.check(1, high) is None
    msg = guard.check(2, high)
    assert msg is not None and "dtype" in msg and "stale adapter" in msg and "tokenization" in msg
    assert guard.check(3, high) is None, "warns once per episode"
    assert guard.check(4, low) is None and guard.check(5, high) is None
    assert guard.check(6, high) is not None, "re-armed after recovering"
    lagged = MismatchGuard(MismatchGuardConfig())
    assert lagged.check(7, {**high, "off_policy_level": 1}) is None, "off-policy steps are not judged by default"
    assert lagged.check(8, {**high, "off_policy_level": 0}) is not None
    every = MismatchGuard(MismatchGuardConfig(scope="all"))
    assert every.check(7, {**high, "off_policy_level": 1}) is not None
    stop = MismatchGuard(MismatchGuardConfig(patience=1, action="stop", max_token_mult_prob_error=1.02))
    with pytest.raises(MismatchError, match="token_mult_prob_error 1.0500"):
        stop.check(1, {"mismatch_kl": 0.0, "token_mult_prob_error": 1.05})


def math_only(prompts, completions, completion_ids, trainer_state, answer, text, **kw):
    assert len(prompts) == len(completions) == len(completion_ids) == len(answer) == len(text)
    assert trainer_state.global_step == trainer_state["global_step"] == 1 and trainer_state.max_steps is None
    return [None if "x" in t else float(len(c[0]["content"])) * kw["k"] for t, c in zip(text, completions, strict=True)]


def test_scorer_calls_reward_funcs_trl_style(monkeypatch):
    mod = types.ModuleType("tidal_test_rewards")
    mod.math_only = math_only  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tidal_test_rewards", mod)
    cfg = OrchConfig.model_validate({"env_reward_weight": 0.5, "reward_funcs": [
        {"import_path": "tidal_test_rewards:math_only", "weight": 2.0, "kwargs": {"k": 0.1}}]})
    env = make_env("reverse-text", {})
    scorer = Scorer(env, cfg)
    assert scorer.names == ["reverse-text", "math_only"] and scorer.weights == [0.5, 2.0]
    comps = [Completion([1], [0.0], "<reversed_text>cba</reversed_text>", "stop"), Completion([1], [0.0], "zz", "stop")]
    per = scorer.score(Example(prompt=[], answer="cba", info={"text": "abc"}), comps, step=1)
    assert per[:, 0].tolist() == [1.0, 0.0] and np.allclose(per[:, 1], [3.4, 0.2])
    per = scorer.score(Example(prompt=[], answer="xba", info={"text": "abx"}), comps, step=1)
    assert np.isnan(per[:, 1]).all()


def test_reverse_text_step_rewards_map_to_tokens():
    env = make_env("reverse-text", {})
    ex = Example(prompt=[], answer="olleh dlrow", info={})
    text = "<reversed_text>olleh dlrxw</reversed_text>"
    steps = env.step_rewards(ex, text)
    assert steps == [(len("<reversed_text>olleh"), 1.0), (len("<reversed_text>olleh dlrxw"), 0.0)]
    comp = Completion(list(range(len(text))), [0.0] * len(text), text, "stop", list(text))  # one char per token
    scorer = Scorer(env, OrchConfig())
    assert scorer.step_rewards(ex, comp) == [(len("<reversed_text>olleh") - 1, 1.0),
                                             (len("<reversed_text>olleh dlrxw") - 1, 0.0)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_matches_float64_loop(temperature):
    from tidal.trainer.step.logprobs import entropy

    logits = torch.randn(2, 7, 11) * 3
    got = entropy(logits, temperature, chunk=3)
    assert got.shape == (2, 7) and torch.all(got[:, 0] == 0)
    for b in range(2):
        for t in range(1, 7):
            z = [float(x) / temperature for x in logits[b, t - 1].double()]
            mx = max(z)
            zs = sum(math.exp(v - mx) for v in z)
            p = [math.exp(v - mx) / zs for v in z]
            want = -sum(pi * math.log(pi) for pi in p)
            assert abs(float(got[b, t]) - want) <= 1e-5 * max(want, 1)
