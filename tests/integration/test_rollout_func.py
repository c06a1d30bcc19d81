"""`GRPOTrainer(rollout_func=...)` on the real vLLM server: the user's function samples a group through tidal's
server (`trainer.vllm_generation.generate`, `generate_rollout_completions`), its extra fields reach the reward
functions, its token ids and logprobs are what the TrainingBatch carries, malformed output names the key, what
tidal cannot give is refused at the call, and the in-flight stream samples its groups through it."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
from transformers import AutoTokenizer

from tests.conftest import MODEL
from tests.integration.streams import take_first
from tidal import generate_rollout_completions
from tidal.config.orch import ClientSection, OrchConfig
from tidal.envs import make_env
from tidal.envs.base import Example
from tidal.inference.backends.vllm.client import VllmClient
from tidal.models.sources import resolve_model
from tidal.orchestrator.assemble import build_batch
from tidal.orchestrator.envmix import EnvMix
from tidal.orchestrator.groups import group_rollouts
from tidal.orchestrator.preflight import give_tools
from tidal.orchestrator.rollout_func import RolloutFunc
from tidal.orchestrator.scoring import Scorer

pytestmark = pytest.mark.vllm

N = 4
CFG = OrchConfig(seq_len=256, batch_size=N, rollouts_per_example=N, sampling={"max_tokens": 16, "seed": 5})
EXAMPLE = Example(prompt="reverse: hello world", answer="dlrow olleh")


def run_group(url: str, fn, example: Example = EXAMPLE):
    """`fn` as the environment's rollout function for one group of `example` (through `group_rollouts`, as the
    orchestrator samples a batch), with the example's prompt ids and the environment."""
    env = make_env("reverse-text")
    env.rollout_func = RolloutFunc(fn, MODEL, AutoTokenizer.from_pretrained(resolve_model(MODEL)))

    async def go():
        client = VllmClient(ClientSection(base_url=[url]))
        try:
            await client.wait_ready()
            prompt = await client.tokenize_prompt(MODEL, example.prompt)
            groups = await group_rollouts(1, CFG, env, client, MODEL, [example], [prompt], 0, [[]])
            return prompt, groups[0]
        finally:
            await client.close()

    return env, *asyncio.run(go())


def test_generate_helper_tokens_logprobs_and_extra_fields_reach_batch_and_rewards(vllm_server):
    returned, profiled = {}, []

    @contextlib.contextmanager
    def profiler():
        profiled.append("enter")
        yield
        profiled.append("exit")

    def rollout(prompts, trainer):
        assert prompts == [EXAMPLE.prompt] * N and trainer.num_generations == N
        ids = [trainer.processing_class.encode(p) for p in prompts]
        prompt_ids, completion_ids, logprobs, top_ids = trainer.vllm_generation.generate(
            prompts=ids, images=None, num_generations=N, profiler=profiler())
        assert all(len(lp) == len(c) and all(len(x) == 1 for x in lp)
                   for lp, c in zip(logprobs, completion_ids, strict=True))
        secret = [float(len(c)) + 0.5 for c in completion_ids]
        shifted = [[[x[0] - 0.25] for x in lp] for lp in logprobs]  # what tidal trains on is what it returns
        returned.update(prompt_ids=prompt_ids, completion_ids=completion_ids,
                        logprobs=[[x[0] for x in lp] for lp in shifted], secret=secret)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": shifted,
                "logprob_token_ids": top_ids, "secret": secret, "tag": "same-for-all"}

    seen = {}

    def reads_secret(completions, secret, tag, completion_ids, **kw):
        seen.update(tag=tag, completion_ids=completion_ids)
        return list(secret)

    env, default_prompt, comps = run_group(vllm_server, rollout)
    assert [c.token_ids for c in comps] == returned["completion_ids"]
    assert len(set(map(tuple, returned["completion_ids"]))) > 1, "the group's completions are sampled, not one"
    assert all(c.prompt_ids == returned["prompt_ids"][0] for c in comps)
    assert profiled == ["enter", "exit"], "TRL's profiler context is held around the requests"

    scores = Scorer(env, CFG, [("reads_secret", reads_secret, 1.0)]).score(EXAMPLE, comps, 1)
    np.testing.assert_array_equal(scores[:, -1], returned["secret"])
    assert seen["tag"] == ["same-for-all"] * N and seen["completion_ids"] == returned["completion_ids"]

    prompt = comps[0].prompt_ids
    batch, _ = build_batch(1, [prompt], [comps], scores[:, -1], [np.ones(len(c.token_ids)) for c in comps], 0, CFG)
    want_tokens = [t for c in returned["completion_ids"] for t in prompt + c]
    want_lps = [x for lp in returned["logprobs"] for x in [0.0] * len(prompt) + lp]
    np.testing.assert_array_equal(batch.tokens, want_tokens)
    np.testing.assert_array_equal(batch.inference_logprobs, np.asarray(want_lps, dtype=batch.inference_logprobs.dtype))
    assert batch.loss_mask.sum() == sum(len(c) for c in returned["completion_ids"])


def test_generate_rollout_completions_chat_prompts_and_env_mask(vllm_server):
    messages = [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": "abc def"}]
    example = Example(prompt=messages, answer="fed cba")

    def rollout(prompts, trainer):
        outs = generate_rollout_completions(trainer, prompts)
        return {"prompt_ids": [o["prompt_ids"] for o in outs], "completion_ids": [o["completion_ids"] for o in outs],
                "logprobs": [o["logprobs"] for o in outs],
                "env_mask": [[1] * (len(o["completion_ids"]) - 1) + [0] for o in outs],
                "text_len": [len(o["text"]) for o in outs]}

    env, default_prompt, comps = run_group(vllm_server, rollout, example)
    assert comps[0].prompt_ids == default_prompt, "chat messages rendered with the model's chat template"
    assert all(c.mask == [1] * (len(c.token_ids) - 1) + [0] for c in comps)
    assert [c.fields["text_len"] for c in comps] == [len(c.text) for c in comps]
    assert all(len(c.logprobs) == len(c.token_ids) and max(c.logprobs) <= 0 for c in comps)


@pytest.mark.parametrize(("out", "error"), [
    (lambda p, ids, lps: {"prompt_ids": [p] * N, "completion_ids": ids}, r"must return keys \['logprobs'\]"),
    (lambda p, ids, lps: {"prompt_ids": [p] * N, "completion_ids": ids[:-1], "logprobs": lps},
     r"'completion_ids' has 3 rows, expected a list of 4"),
    (lambda p, ids, lps: {"prompt_ids": [p] * N, "completion_ids": ids, "logprobs": [lp[:-1] for lp in lps]},
     r"'logprobs'\[0\] has \d+ values for \d+ completion tokens"),
    (lambda p, ids, lps: {"prompt_ids": [p] * N, "completion_ids": ids, "logprobs": lps, "completions": 1},
     r"output key 'completions' is a keyword tidal passes"),
])
def test_malformed_output_names_the_key(vllm_server, out, error):
    def rollout(prompts, trainer):
        outs = generate_rollout_completions(trainer, prompts, generation_overrides={"max_tokens": 4})
        return out(outs[0]["prompt_ids"], [o["completion_ids"] for o in outs], [o["logprobs"] for o in outs])

    with pytest.raises((ValueError, TypeError), match=error):
        run_group(vllm_server, rollout)


@pytest.mark.parametrize(("reach", "error"), [
    (lambda trainer: trainer.model, "trainer.model is not available to a rollout_func in tidal"),
    (lambda trainer: trainer.vllm_generation.sync_weights(), "trainer.vllm_generation.sync_weights is not available"),
    (lambda trainer: trainer.vllm_generation.generate([[1, 2]], images=[["img"]], num_generations=1),
     r"generate\(images=...\): tidal samples a rollout_func's requests from token ids only"),
    (lambda trainer: trainer.vllm_generation.generate([[1, 2], [3]], num_generations=2),
     r"prompts\[0:2\] are not one prompt repeated num_generations=2 times"),
])
def test_what_tidal_cannot_give_is_refused_at_the_call(vllm_server, reach, error):
    with pytest.raises((AttributeError, NotImplementedError, ValueError), match=error):
        run_group(vllm_server, lambda prompts, trainer: reach(trainer))


def test_in_flight_stream_samples_groups_through_the_rollout_func(vllm_server, tmp_path):
    """`async_mode: in_flight`: each streamed group is the function's (whole, not split per completion), and the
    stream closes with groups still in the function's threads."""
    cfg = OrchConfig.model_validate({"batch_size": 8, "rollouts_per_example": N, "seq_len": 256,
                                     "sampling": {"max_tokens": 8}, "async_mode": "in_flight",
                                     "env": [{"id": "reverse-text"}]})
    env = EnvMix(cfg.env, cfg.buffer.env_ratios)

    def rollout(prompts, trainer):
        outs = generate_rollout_completions(trainer, prompts)
        cut = [o["completion_ids"][:2] for o in outs]
        return {"prompt_ids": [o["prompt_ids"] for o in outs], "completion_ids": cut,
                "logprobs": [o["logprobs"][:len(c)] for o, c in zip(outs, cut, strict=True)]}

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    give_tools(env.envs.values(), None, RolloutFunc(rollout, MODEL, tokenizer))
    got = take_first(vllm_server, cfg, 5, tmp_path, env=env)[0].collected
    comps = [c for g in got.groups for c in g]
    assert len(got.groups) == 2 and len(comps) == 8
    assert all(1 <= len(c.token_ids) <= 2 and len(c.logprobs) == len(c.token_ids) for c in comps)
