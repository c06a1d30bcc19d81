"""orch `guide_flat_groups` without a server: the keys it refuses to combine with (config and up-front environment
checks, exit 2 material), the EOS token a reference completion ends with, and the advantages of a guided group
against a float64 reference (the guided group's own pool is the usual group baseline)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from pydantic import ValidationError

from tidal.config.load import ConfigError
from tidal.config.orch import OrchConfig
from tidal.envs.base import Example
from tidal.orchestrator.advantage import EPS, group_advantages, pooled_advantages
from tidal.orchestrator.guide import auto_off, fill_template, reference_eos, reference_text, resolved
from tidal.orchestrator.preflight import build_scoring


def orch(**kw) -> OrchConfig:
    return OrchConfig.model_validate({"batch_size": 8, "rollouts_per_example": 4, "guide_flat_groups": 1, **kw})


@pytest.mark.parametrize(("kw", "key"), [
    ({"sampling": {"temperature": 0.7}}, "sampling.temperature"),
    ({"max_steps": 5, "sampling": {"temp_scheduler": {"type": "linear", "start_temperature": 1.0,
                                                "end_temperature": 0.5}}}, "sampling.temp_scheduler"),
    ({"sampling": {"top_p": 0.9}}, "sampling.top_p"),
    ({"sampling": {"top_k": 20}}, "sampling.top_k"),
    ({"sampling": {"min_p": 0.05}}, "sampling.min_p"),
    ({"sampling": {"repetition_penalty": 1.1}}, "sampling.repetition_penalty"),
    ({"sampling": {"min_tokens": 2}}, "sampling.min_tokens"),
    ({"async_mode": "in_flight"}, "async_mode"),
    ({"advantage": {"type": "process"}}, "advantage.type"),
    ({"advantage": {"length_weighted_mean": True}}, "advantage.length_weighted_mean"),
])
def test_guide_refuses_what_it_does_not_combine_with(kw, key):
    with pytest.raises(ValidationError, match=f"guide_flat_groups: 1 does not combine with {key}"):
        orch(**kw)
    assert orch(**kw, guide_flat_groups=0).guide_flat_groups == 0


def test_guide_keeps_some_of_the_groups_own_completions():
    with pytest.raises(ValidationError, match=r"guide_flat_groups: 4 must be below rollouts_per_example \(4\)"):
        orch(guide_flat_groups=4)
    assert orch(guide_flat_groups=3, sampling={"top_k": 0}).guide_flat_groups == 3


def model_dir(tmp_path, name, files):
    d = tmp_path / name
    d.mkdir()
    for f, data in files.items():
        (d / f).write_text(json.dumps(data))
    return str(d)


def test_the_reference_ends_with_the_token_vllm_stops_at(tmp_path):
    assert reference_eos(model_dir(tmp_path, "gen", {"generation_config.json": {"eos_token_id": [106, 1]},
                                                     "config.json": {"eos_token_id": 7}})) == 106
    assert reference_eos(model_dir(tmp_path, "cfg", {"config.json": {"eos_token_id": 2}})) == 2
    assert reference_eos(model_dir(tmp_path, "vlm", {"config.json": {"text_config": {"eos_token_id": 5}}})) == 5
    with pytest.raises(ValueError, match="names no eos_token_id"):
        reference_eos(model_dir(tmp_path, "none", {"config.json": {"vocab_size": 9}}))


def test_a_multi_turn_environment_is_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="does not combine with env 'calculator': it has 3 turns"):
        build_scoring(orch(env=[{"id": "calculator"}]))
    build_scoring(orch(env=[{"id": "calculator"}], guide_flat_groups=0))


def test_the_models_eos_is_looked_up_front(tmp_path):
    build_scoring(orch(model={"name": "tidal:tiny-reverse"}))  # the bundled model names its EOS: nothing refused
    with pytest.raises(ConfigError, match="names no eos_token_id"):
        build_scoring(orch(model={"name": model_dir(tmp_path, "m", {"config.json": {}})}))


@pytest.mark.parametrize("scale", ["none", "group", "batch"])
@pytest.mark.parametrize("seed", range(3))
def test_a_guided_groups_pool_gives_its_usual_advantages(scale, seed):
    """A guided group's `Pool` is its own trained rewards' mean and unbiased std: the advantages are the ones the
    group would get without a pool (float64 reference: TRL's formula, ddof 1 + EPS)."""
    rng = np.random.default_rng(seed)
    k, groups = 8, 5
    rewards = rng.integers(0, 2, size=groups * k).astype(np.float64)
    rewards[:k] = [0.0] * (k - 1) + [1.0]  # a guided group: 7 sampled failures and the reference
    pools = [(float(rewards[:k].mean()), float(rewards[:k].std(ddof=1)))] + [None] * (groups - 1)
    plain = group_advantages(rewards, k, scale)
    got = pooled_advantages(plain, rewards, k, pools, scale)
    g = rewards[:k]
    mean = sum(g) / k
    std = (sum((r - mean) ** 2 for r in g) / (k - 1)) ** 0.5
    ref = [(r - mean) / {"none": 1.0, "group": std + EPS, "batch": float(np.std(rewards, ddof=1)) + EPS}[scale]
           for r in g]
    np.testing.assert_allclose(got[:k], ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(got[k:], plain[k:])


def test_the_template_takes_the_answer_and_the_examples_fields():
    ex = Example(prompt="3 + 4 =", answer="7", info={"a": 3, "b": 4}, task="addition")
    assert fill_template("{answer}", ex) == "7"
    assert fill_template("{a} + {b} = {answer}", ex) == "3 + 4 = 7"
    assert fill_template("\\\\boxed{{{answer}}}", ex) == "\\\\boxed{7}"
    with pytest.raises(ValueError, match=r"'\{c\} = \{answer\}': KeyError\('c'\) for an example of environment "
                                         r"'addition', whose fields are answer and \['a', 'b'\]"):
        fill_template("{c} = {answer}", ex)


def envs_of(cfg: OrchConfig) -> dict:
    return build_scoring(cfg).env.envs


def test_auto_guides_a_run_whose_environments_write_worked_answers(caplog):
    """`auto` (the default) resolves to 1 for `addition` (it writes worked answers) and says so; to 0 for an
    environment that does not, or a run that guidance does not fit, saying why; a number stays as it is."""
    assert OrchConfig().guide_flat_groups == "auto" and OrchConfig().guide_count() == 0
    cfg = OrchConfig.model_validate({"batch_size": 8, "rollouts_per_example": 4, "env": [{"id": "addition"}]})
    with caplog.at_level("INFO", logger="tidal.orch"):
        on = resolved(cfg, envs_of(cfg), "tidal:tiny-reverse")
    assert on.guide_flat_groups == 1 and on.guide_count() == 1
    assert "guidance on (orch guide_flat_groups auto: env addition writes" in caplog.text
    for kw, why in [({"env": [{"id": "reverse-text"}]}, "env reverse-text writes no worked reference answers"),
                    ({"env": [{"id": "addition"}, {"id": "reverse-text"}]}, "env reverse-text writes no worked"),
                    ({"sampling": {"temperature": 0.7}}, "does not combine with sampling.temperature 0.7"),
                    ({"async_mode": "in_flight"}, "does not combine with async_mode 'in_flight'"),
                    ({"rollouts_per_example": 1, "batch_size": 4}, "does not combine with rollouts_per_example 1")]:
        cfg = OrchConfig.model_validate({"batch_size": 8, "rollouts_per_example": 4, "env": [{"id": "addition"}],
                                         **kw})
        caplog.clear()
        with caplog.at_level("INFO", logger="tidal.orch"):
            assert resolved(cfg, envs_of(cfg), "tidal:tiny-reverse").guide_flat_groups == 0, kw
        assert f"guidance off (orch guide_flat_groups auto): {''}" in caplog.text and why in caplog.text, caplog.text
    explicit = orch(env=[{"id": "reverse-text"}], guide_flat_groups=2)
    assert resolved(explicit, envs_of(explicit), "tidal:tiny-reverse").guide_flat_groups == 2


def test_auto_leaves_a_model_without_eos_unguided(tmp_path, caplog):
    cfg = OrchConfig.model_validate({"batch_size": 8, "rollouts_per_example": 4, "env": [{"id": "addition"}]})
    with caplog.at_level("INFO", logger="tidal.orch"):
        out = resolved(cfg, envs_of(cfg), model_dir(tmp_path, "m", {"config.json": {}}))
    assert out.guide_flat_groups == 0 and "names no eos_token_id" in caplog.text


def test_auto_leaves_a_multi_turn_environment_unguided():
    cfg = OrchConfig.model_validate({"batch_size": 8, "rollouts_per_example": 4, "env": [{"id": "calculator"}]})
    env = envs_of(cfg)
    env["calculator"].worked_reference = True  # an instance that says so: still 3 turns
    assert "env 'calculator' has 3 turns" in auto_off(cfg, env, "tidal:tiny-reverse")


@pytest.mark.parametrize("fmt", ["chat", "text"])
def test_without_a_template_the_environment_writes_the_reference(fmt):
    """guide_template None (the default): the example's environment's reference completion, which for `addition`
    is the worked answer its reward accepts; an environment without one gives none (its groups stay unguided)."""
    cfg = orch(env=[{"id": "addition", "args": {"prompt_format": fmt}}])
    env = envs_of(cfg)
    ex = env["addition"].sample(random.Random(3))
    ex.task = "addition"
    text = reference_text(cfg, env, ex)
    a, b = ex.info["a"], ex.info["b"]
    assert text == (f"{a} + {b} = {a + b}" if fmt == "chat" else f" {a + b}")
    assert env["addition"].reward(ex, text) == 1.0
    assert reference_text(cfg.model_copy(update={"guide_template": "{answer}"}), env, ex) == str(a + b)
    plain = orch(env=[{"id": "calculator"}], guide_flat_groups=0)
    calc = envs_of(plain)
    calc["calculator"].reference_completion = lambda _ex: (_ for _ in ()).throw(NotImplementedError())
    assert reference_text(plain, calc, Example(prompt="x", answer="1", task="calculator")) is None


def test_a_negative_count_is_refused():
    with pytest.raises(ValidationError, match="guide_flat_groups must be >= 0 or auto, got -1"):
        orch(guide_flat_groups=-1)
    with pytest.raises(ValidationError):
        orch(guide_flat_groups="sometimes")
