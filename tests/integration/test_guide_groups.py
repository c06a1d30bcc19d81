"""orch `guide_flat_groups` against the real vLLM server: a group whose completions all failed trains on the
example's reference answer in place of its last completion, tokenized by the server and ended by the model's EOS,
with the served policy's logprobs of those tokens (checked against transformers' forward of the same model) and the
group's own advantages; a reference that does not score higher leaves the group as sampled.

The reward (`exact`): 1.0 when a completion is exactly the reversed text (`reverse_text`'s answer), which the
bundled model's completions almost never are, so most groups are flat at 0."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import MODEL, on_server
from tests.integration.streams import gated_batch
from tidal.config.orch import OrchConfig
from tidal.envs.reverse_text import CLOSE, OPEN
from tidal.models.sources import resolve_model
from tidal.orchestrator.advantage import combine_rewards
from tidal.orchestrator.assemble import assemble
from tidal.orchestrator.filters import Filters
from tidal.orchestrator.groups import StepSample
from tidal.orchestrator.guide import reference_eos

pytestmark = pytest.mark.vllm


def exact(completions, answer, **_):
    return [1.0 if c[-1]["content"].strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def tagged(completions, answer, **_):
    """1.0 for exactly `reverse_text`'s own reference completion (the answer in its tags)."""
    return [1.0 if c[-1]["content"].strip() == f"{OPEN}{a}{CLOSE}" else 0.0
            for c, a in zip(completions, answer, strict=True)]


def collect(url: str, tmp_path, **kw):
    cfg = OrchConfig.model_validate({
        "batch_size": 16, "rollouts_per_example": 4, "seq_len": 256,
        "sampling": {"max_tokens": 24, "seed": 11}, "env_reward_weight": 0.0,
        "reward_funcs": [{"import_path": "tests.integration.test_guide_groups:exact"}], **kw})
    counts: dict[str, float] = {}
    got, scorer, _ = gated_batch(url, cfg, tmp_path, counts)
    done = assemble(1, StepSample(got, 0.0, 1.0), cfg, scorer, Filters([], None), None)
    rewards = [combine_rewards(s, scorer.weights)[0] for s in got.per_func]
    return got, counts, done, rewards


def tokenize(url: str, text: str) -> list[int]:
    return on_server(url, lambda client: client.tokenize_text(MODEL, text))


def transformers_logprobs(prompt: list[int], ids: list[int]) -> np.ndarray:
    """float64 log-softmax of the bundled model's logits (transformers, float32 weights) at each of `ids`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model(MODEL), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0].numpy()


def test_a_failed_group_trains_on_the_reference_answer_as_the_policy_scores_it(vllm_server, tmp_path):
    plain, counts0, done0, rewards0 = collect(vllm_server, tmp_path)
    flat = [i for i, r in enumerate(rewards0) if not r.any()]
    assert flat, "the bundled model's 8-token tries should fail some group entirely"
    assert counts0.get("guide/groups", 0) == 0

    got, counts, done, rewards = collect(vllm_server, tmp_path, guide_flat_groups=1, guide_template="{answer}")
    guided = [i for i in flat if len(tokenize(vllm_server, got.examples[i].answer)) < 24]  # room for the EOS
    assert guided and counts["guide/groups"] == counts["guide/completions"] == len(guided)
    assert counts.get("guide/too_long", 0) == len(flat) - len(guided)
    eos = reference_eos(MODEL)
    for i, (ex, g) in enumerate(zip(got.examples, got.groups, strict=True)):
        assert [c.token_ids for c in g[:3]] == [c.token_ids for c in plain.groups[i][:3]], "same seeds, same tries"
        if i not in guided:
            assert g[3].token_ids == plain.groups[i][3].token_ids and got.pools[i] is None
            continue
        ref = g[3]
        assert ref.text == ex.answer and ref.finish_reason == "stop"
        assert ref.token_ids == [*tokenize(vllm_server, ex.answer), eos]
        np.testing.assert_allclose(ref.logprobs, transformers_logprobs(got.prompts[i], ref.token_ids), atol=2e-4)
        assert rewards[i].tolist() == [0.0, 0.0, 0.0, 1.0]
        pool = got.pools[i]
        assert pool is not None and (pool.mean, pool.size, pool.first_mean) == (0.25, 4, 0.0)
        assert pool.std == pytest.approx(0.5)
    k = 4
    adv = np.array([a[0] for a in done.advantages]).reshape(-1, k)
    for i in range(len(got.groups)):
        r = rewards[i]
        np.testing.assert_allclose(adv[i], r - r.mean(), rtol=0, atol=1e-12)  # scale_rewards none: the group mean
    assert done.batch.metrics["reward/sampled_mean"] == pytest.approx(done0.batch.metrics["reward/mean"])
    assert done.batch.metrics["reward/mean"] == pytest.approx(done0.batch.metrics["reward/mean"] + len(guided) / 16)


def test_a_reference_that_scores_no_higher_leaves_the_group_as_sampled(vllm_server, tmp_path):
    plain, _, _, rewards0 = collect(vllm_server, tmp_path)
    got, counts, _, _ = collect(vllm_server, tmp_path, guide_flat_groups=1, guide_template="answer: {answer}")
    flat = [i for i, r in enumerate(rewards0) if not r.any()]
    tried = counts.get("guide/no_gain", 0) + counts.get("guide/too_long", 0)
    assert counts["guide/no_gain"] and tried == len(flat) and counts.get("guide/groups", 0) == 0
    assert [[c.token_ids for c in g] for g in got.groups] == [[c.token_ids for c in g] for g in plain.groups]
    assert all(p is None for p in got.pools)


def test_without_a_template_the_environment_writes_the_reference(vllm_server, tmp_path):
    """guide_template unset: the reference is the environment's own `reference_completion` (reverse_text's answer in
    its tags), tokenized by the server and ended by EOS, trained where the run's reward prefers it."""
    reward = [{"import_path": "tests.integration.test_guide_groups:tagged"}]
    plain, _, _, rewards0 = collect(vllm_server, tmp_path, reward_funcs=reward)
    got, counts, _, rewards = collect(vllm_server, tmp_path, reward_funcs=reward, guide_flat_groups=1)
    flat = [i for i, r in enumerate(rewards0) if not r.any()]
    guided = [i for i in flat if got.pools[i] is not None]
    assert guided and counts["guide/groups"] == len(guided)
    assert counts.get("guide/too_long", 0) == len(flat) - len(guided)
    for i in guided:
        ex, ref = got.examples[i], got.groups[i][3]
        assert ref.text == f"{OPEN}{ex.answer}{CLOSE}"
        assert ref.token_ids == [*tokenize(vllm_server, ref.text), reference_eos(MODEL)]
        assert rewards[i].tolist() == [0.0, 0.0, 0.0, 1.0]
