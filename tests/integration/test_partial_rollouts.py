"""Partial rollouts (orch `partial_rollouts: abort_resume`, issue 52) against the real vLLM server: completions
running when a newer LoRA policy is loaded are stopped and continued on it, every token keeping the version and
the behaviour logprob it was sampled with.

The on-policy check: policies 1 and 2 are the same adapter published twice (a learning rate of 0), so a continued
completion must be what an uninterrupted one would have been: greedy, the very same tokens; sampled, behaviour
logprobs that the trainer's float32 forward (PEFT) reproduces with a mismatch KL (k3, per token, float64 over the
float32 logprobs) at the CPU floor. A random non-trivial adapter on the bundled model, built from its config."""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import pytest
import torch

from tests.conftest import MODEL
from tests.integration.streams import open_stream
from tidal.config.orch import ClientSection, SamplingSection
from tidal.inference.backends.vllm.client import VllmClient
from tidal.orchestrator.partial import Switch, partial_completion, partial_group
from tidal.orchestrator.policy import PolicyTracker
from tidal.trainer.model.load import load_base_model
from tidal.trainer.step.logprobs import forward_logprobs
from tidal.transport import weights

pytestmark = pytest.mark.vllm

LONG = 460  # tokens per completion (min_tokens = max_tokens: no early EOS; the server's max_model_len is 512)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(path, trained: bool):
    """A LoRA adapter of the bundled model (saved to `path`) and its PEFT model (the trainer's view): `trained`, a
    random non-trivial one; else as PEFT initializes it (B = 0), what a trainer at learning rate 0 publishes."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(random.SystemRandom().randrange(2**31))
    base = load_base_model(MODEL, torch.device("cpu"), torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name and trained:
                p.normal_(0, 0.05)
    model.save_pretrained(str(path))
    return path, model.eval()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return make_adapter(tmp_path_factory.mktemp("adapter"), trained=True)


@pytest.fixture(scope="module")
def lr0_adapter(tmp_path_factory):
    return make_adapter(tmp_path_factory.mktemp("adapter0"), trained=False)


def publish(run_dir, step, adapter_dir):
    import shutil

    weights.publish(run_dir, step, lambda tmp: [shutil.copy(f, tmp / f.name) for f in adapter_dir.iterdir()])


async def switch_when_running(switch: Switch, policy: PolicyTracker, run_dir, adapter_dir, after_s: float) -> None:
    """Once requests run, publish policy 2 (the same adapter: lr 0) and do what the stream's follower does."""
    while not switch.running:
        await asyncio.sleep(0.005)
    await asyncio.sleep(after_s)
    publish(run_dir, 2, adapter_dir)
    await switch.before_load()
    try:
        await policy.ensure(0, 60)
    finally:
        switch.after_load()


def run(vllm_server, tmp_path, adapter_dir, body):
    async def go():
        client = VllmClient(ClientSection(base_url=[vllm_server]))
        try:
            await client.wait_ready()
            publish(tmp_path, 1, adapter_dir)
            policy = PolicyTracker(client, MODEL, tmp_path, "partial")
            await policy.ensure(1, 60)
            switch = Switch("abort_resume", policy, merged=False)
            prompt = await client.tokenize_text(MODEL, "reverse: hello world")
            try:
                return await body(client, policy, switch, prompt), switch
            finally:
                await client.unload_adapter(policy.model)
        finally:
            await client.close()
    return asyncio.run(go())


def test_a_continued_greedy_completion_is_the_uninterrupted_one(vllm_server, tmp_path, adapter):
    adapter_dir, _ = adapter
    sampling = SamplingSection(max_tokens=LONG, min_tokens=LONG, temperature=1.0)

    async def body(client, policy, switch, prompt):
        whole = (await client.sample(policy.model, prompt, 1, LONG, 0.0, None, {"min_tokens": LONG}))[0]
        switcher = asyncio.create_task(switch_when_running(switch, policy, tmp_path, adapter_dir, 0.05))
        cont = await partial_completion(switch, client, prompt, LONG, sampling, 0.0, None)
        await switcher
        return whole, cont

    (whole, cont), switch = run(vllm_server, tmp_path, adapter_dir, body)
    v = np.array(cont.versions)
    assert set(v.tolist()) == {1, 2} and (np.diff(v) >= 0).all(), "the switch must land mid-completion"
    assert switch.counts["partial/resumed_requests"] >= 1 and switch.counts["partial/stopped_requests"] >= 1
    assert cont.finish_reason == whole.finish_reason == "length" and len(cont.token_ids) == LONG
    assert cont.token_ids == whole.token_ids, "greedy: the continued completion must be the uninterrupted one"
    assert np.abs(np.array(cont.logprobs) - np.array(whole.logprobs)).max() < 1e-4
    assert cont.text == whole.text


def test_sample_stream_ends_where_until_says(vllm_server):
    """`VllmClient.sample_stream(until=...)`: the request ends after the chunk whose text and token count `until`
    accepts, with finish reason `stop` and those tokens only (vLLM aborts the rest as the connection closes); the
    server keeps serving."""
    async def go():
        client = VllmClient(ClientSection(base_url=[vllm_server]))
        try:
            prompt = await client.tokenize_text(MODEL, "reverse: hello world")
            seen: list[tuple[str, int]] = []

            def until(text: str, tokens: int) -> bool:
                seen.append((text, tokens))
                return tokens >= 5

            part = await client.sample_stream(MODEL, prompt, 50, 0.0, asyncio.Event(), None, {"min_tokens": 50},
                                              until=until)
            whole = (await client.sample(MODEL, prompt, 1, 50, 0.0, None, {"min_tokens": 50}))[0]
            return part, whole, seen
        finally:
            await client.close()

    part, whole, seen = asyncio.run(go())
    assert part.finish_reason == "stop" and len(part.token_ids) == 5 and seen[-1][1] == 5
    assert part.token_ids == whole.token_ids[:5] and seen[-1][0] == part.text


class Echo:
    """A two-turn environment whose model turns end at EOS or `stop`; it answers the first turn with `REPLY`."""

    id, max_turns, REPLY = "echo", 2, " [tool: go on] "

    def __init__(self, stop: str) -> None:
        self.stop = [stop]

    def respond(self, example, transcript):
        return None if self.REPLY in transcript else self.REPLY


def late_stop(probe, min_tokens: int) -> str:
    """A stop string that ends a greedy turn like `probe` (sampled with `min_tokens`) a few tokens past `min_tokens`:
    the 4 characters of its text from token `min_tokens` + 3 on (vLLM matches a stop string only where it ends past
    the text of the first `min_tokens` tokens, so the turn ends there or earlier, but not before `min_tokens`)."""
    pieces = probe.token_texts or []
    assert "".join(pieces) == probe.text, "the bundled model's tokens are plain text pieces"
    at = sum(map(len, pieces[:min_tokens + 3]))
    stop = probe.text[at:at + 4]
    assert len(stop) == 4, probe.text
    return stop


def test_a_multi_turn_rollout_continued_mid_turn_is_the_uninterrupted_one(vllm_server, tmp_path, adapter):
    """Greedy, a two-turn rollout (`multi_turn_group`, stop strings) with a LoRA switch while it runs and
    `PartialTurns`: the very tokens, mask and text of the uninterrupted rollout; the switch lands inside a model
    turn (its tokens span versions 1 -> 2) and the environment's reply takes the version of the token before it."""
    from tidal.envs.base import Example
    from tidal.orchestrator.partial import PartialTurns
    from tidal.orchestrator.rollout import multi_turn_group

    adapter_dir, _ = adapter
    first = 200  # min_tokens of the first turn: it runs long enough for the switch to land in it

    async def body(client, policy, switch, prompt):
        probe = (await client.sample(policy.model, prompt, 1, first + 60, 0.0, None, {"min_tokens": first}))[0]
        env, ex = Echo(late_stop(probe, first)), Example(prompt="x")
        sampling = SamplingSection(max_tokens=480, min_tokens=first)
        whole = (await multi_turn_group(client, policy.model, prompt, 1, sampling, 512, None, 0.0, env, ex))[0]
        switcher = asyncio.create_task(switch_when_running(switch, policy, tmp_path, adapter_dir, 0.05))
        cont = (await multi_turn_group(client, policy.model, prompt, 1, sampling, 512, None, 0.0, env, ex,
                                       PartialTurns(switch, client, 0.0)))[0]
        await switcher
        return whole, cont

    (whole, cont), switch = run(vllm_server, tmp_path, adapter_dir, body)
    assert whole.mask is not None and 0 in whole.mask, f"the environment must have answered: {whole.text!r}"
    assert cont.token_ids == whole.token_ids and cont.mask == whole.mask and cont.text == whole.text
    assert cont.finish_reason == whole.finish_reason
    assert np.abs(np.array(cont.logprobs) - np.array(whole.logprobs)).max() < 1e-4
    v, mask = np.array(cont.versions), np.array(cont.mask)
    assert len(v) == len(cont.token_ids) and (np.diff(v) >= 0).all() and set(v.tolist()) == {1, 2}
    reply = np.flatnonzero(mask == 0)
    assert (v[reply] == v[reply[0] - 1]).all(), "the reply takes the version of the model token before it"
    turns = np.split(np.arange(len(v)), [reply[0], reply[-1] + 1])
    assert any(len(set(v[t].tolist())) == 2 for t in (turns[0], turns[2])), "the switch must land inside a turn"
    assert switch.counts["partial/resumed_requests"] >= 1


def test_teacher_logprobs_cover_every_segment_of_a_continued_completion(vllm_server, tmp_path, lr0_adapter):
    """orch `teacher` (`fill.with_teacher`) on a completion continued across a switch: one teacher logprob per
    token of prompt + all segments, and, the teacher being the base model and the policy a learning-rate-0 adapter
    of it, the completion's teacher logprobs are its behaviour logprobs (to the server's prefill / decode
    difference), after the switch as before it."""
    from tidal.config.orch import OrchConfig
    from tidal.envs.base import Example
    from tidal.orchestrator.fill import with_teacher
    from tidal.orchestrator.groups import Collected, StepSample

    adapter_dir, _ = lr0_adapter
    n = 200
    sampling = SamplingSection(max_tokens=n, min_tokens=n)
    cfg = OrchConfig.model_validate({"teacher": {"model": MODEL, "base_url": vllm_server}})

    async def body(client, policy, switch, prompt):
        switcher = asyncio.create_task(switch_when_running(switch, policy, tmp_path, adapter_dir, 0.05))
        cont = await partial_completion(switch, client, prompt, n, sampling, 0.0, None)
        await switcher
        got = Collected()
        got.add(Example(prompt="x"), prompt, [cont], np.zeros((1, 1)), version=(1, max(cont.versions)))
        return prompt, cont, (await with_teacher(StepSample(got, 0.0, 0.0), cfg, client)).teacher

    (prompt, cont, teacher), _ = run(vllm_server, tmp_path, adapter_dir, body)
    assert set(cont.versions) == {1, 2} and len(cont.token_ids) == n, "the switch must land mid-completion"
    assert teacher is not None and len(teacher) == 1 and len(teacher[0]) == len(prompt) + n
    # the teacher scores by prefill and the policy sampled by decoding: up to ~6e-3 apart on this server (seen),
    # alike on both sides of the switch; teacher logprobs of anything but these tokens would be nats off
    diff = np.abs(np.array(teacher[0][len(prompt):]) - np.array(cont.logprobs))
    after = np.array(cont.versions) == 2
    print(f"teacher - behaviour: max {diff.max():.2e}, mean before the switch {diff[~after].mean():.2e}, after "
          f"{diff[after].mean():.2e}")
    assert diff.max() < 2e-2 and diff[after].mean() < 2 * diff[~after].mean() + 1e-3


def trainer_kl(peft_model, prompt: list[int], comps) -> np.ndarray:
    """Per token, the k3 estimate of KL(inference || trainer): the trainer's float32 forward (PEFT) against the
    behaviour logprobs vLLM reported, in float64."""
    out = []
    for c in comps:
        ids = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            ours = forward_logprobs(peft_model, ids, torch.arange(ids.shape[1])[None], 1.0)[0, len(prompt):]
        r = ours.double().numpy() - np.array(c.logprobs, dtype=np.float64)  # log(trainer / inference)
        out.append(np.exp(r) - 1 - r)
    return np.concatenate(out)


@pytest.mark.slow  # ~1 min on 2 busy cores: 6 x 460 tokens sampled and scored by the trainer
def test_sampled_group_spans_the_switch_on_policy(vllm_server, tmp_path, lr0_adapter):
    """n = 4 completions at temperature 1 (seeded) across a switch between two learning-rate-0 policies: the
    trainer scores the continued tokens as closely as it scores uninterrupted completions of the same policy (the
    base model's weights: the adapter's B is 0): mismatch KL at the floor of this server and model, which is
    measured here on two uninterrupted completions rather than assumed."""
    adapter_dir, peft_model = lr0_adapter
    sampling = SamplingSection(max_tokens=LONG, min_tokens=LONG, temperature=1.0, seed=7)
    done: list[int] = []

    async def body(client, policy, switch, prompt):
        switcher = asyncio.create_task(switch_when_running(switch, policy, tmp_path, adapter_dir, 0.2))
        comps = await partial_group(switch, client, prompt, 4, sampling, 512, 7, 1.0, lambda: done.append(1))
        await switcher
        plain = await client.sample(MODEL, prompt, 2, LONG, 1.0, 11, {"min_tokens": LONG})
        return prompt, comps, plain

    (prompt, comps, plain), switch = run(vllm_server, tmp_path, adapter_dir, body)
    assert len(done) == 4 and len(comps) == 4 and switch.counts["partial/switches"] == 1
    spanning = [c for c in comps if len(set(c.versions)) == 2]
    assert spanning, "some completion must span the switch"
    for c in comps:
        assert len(c.token_ids) == len(c.logprobs) == len(c.versions) == LONG and c.finish_reason == "length"
        assert c.versions == sorted(c.versions) and set(c.versions) <= {1, 2}
    continued, floor = float(trainer_kl(peft_model, prompt, spanning).mean()), float(
        trainer_kl(peft_model, prompt, plain).mean())
    print(f"mismatch_kl: continued {continued:.3e} ({len(spanning)} completion(s)), uninterrupted {floor:.3e}")
    assert continued < 3 * floor + 1e-10, f"continued completions are off-policy: mismatch_kl {continued:.3e} " \
                                          f"against {floor:.3e} uninterrupted"


def test_the_in_flight_stream_continues_running_completions_on_a_new_policy(vllm_server, tmp_path, lr0_adapter):
    """`GroupStream` with `partial_rollouts: abort_resume` (the stream's hooks): policy 1 is published while
    groups of n = 2 run on policy 0 (the base model); the batch's completions carry per-token versions, some span
    0 -> 1, and each group's (start, end) are its start and its newest token's version."""
    from tidal.config.orch import OrchConfig

    adapter_dir, _ = lr0_adapter
    cfg = OrchConfig.model_validate({
        "batch_size": 4, "rollouts_per_example": 2, "seq_len": 512, "async_mode": "in_flight",
        "partial_rollouts": "abort_resume", "in_flight_groups": 2, "max_async_level": 2,
        "sampling": {"max_tokens": 300, "min_tokens": 300}})

    async def go():
        async with open_stream(vllm_server, cfg, 5, tmp_path, policy_dir="stream") as stream:
            client, policy = stream.client, stream.policy
            # the running completions hold tokens of policy 0 before the switch (a fixed 0.2 s sleep raced a loaded
            # machine: stopped before their first token, their continuations were all policy 1)
            while not stream.partial.running or client.streamed_tokens < 4 * 8:
                await asyncio.sleep(0.005)
            publish(tmp_path, 1, adapter_dir)  # the follower loads it and the running completions move onto it
            counts: dict[str, float] = {}
            got = await stream.take(1, counts)
            await stream.close()
            await client.unload_adapter(policy.model)
            return got, counts

    got, counts = asyncio.run(go())
    c = got.collected
    assert counts["partial/switches"] >= 1 and counts["partial/stopped_requests"] >= 1
    comps = [comp for group in c.groups for comp in group]
    assert len(comps) == 4 and all(len(x.versions) == len(x.token_ids) == 300 for x in comps)
    assert any(set(x.versions) == {0, 1} for x in comps), "a completion must span the switch"
    for group, (start, end) in zip(c.groups, c.versions, strict=True):
        assert start <= min(v for x in group for v in x.versions) and end == max(v for x in group for v in x.versions)


def test_the_in_flight_stream_continues_multi_turn_rollouts_on_a_new_policy(vllm_server, tmp_path, lr0_adapter):
    """`GroupStream` with `partial_rollouts: abort_resume` and a multi-turn environment (its first turn ends at the
    `<reversed_text>` tag, the environment answers, the model goes on): policy 1 is published while groups run on
    policy 0; requests running at the switch are stopped and resumed on policy 1 (counted), so a rollout holds
    tokens of both policies; every completion carries a version per token, its environment tokens masked
    and versioned like the model token before them, and each group's (start, end) bound its tokens' versions."""
    from tidal.config.orch import OrchConfig

    adapter_dir, _ = lr0_adapter
    cfg = OrchConfig.model_validate({
        "batch_size": 4, "rollouts_per_example": 2, "seq_len": 512, "async_mode": "in_flight",
        "partial_rollouts": "abort_resume", "in_flight_groups": 2, "max_async_level": 2,
        "sampling": {"max_tokens": 300}, "env": [{"id": "tests.e2e.multiturn_env:EchoTool"}]})

    async def go():
        async with open_stream(vllm_server, cfg, 7, tmp_path, policy_dir="stream-mt") as stream:
            client, policy = stream.client, stream.policy
            # policy `step` is published while batch `step`'s groups run; a batch whose switch found no request
            # running (all between turns or done: it depends on the follower's clock), or whose stopped request's
            # group is still running when the batch is taken (groups started after the switch can finish first), is
            # taken and the next one tried, up to 5, so the batch checked holds a rollout stopped and resumed on the
            # new policy; the counts add up over the batches taken
            total: dict[str, float] = {}
            for step in (1, 2, 3, 4, 5):
                base = client.streamed_tokens
                while not stream.partial.running or client.streamed_tokens < base + 8:
                    await asyncio.sleep(0.005)
                publish(tmp_path, step, adapter_dir)
                # the follower loads the policy on its own clock: wait for the switch, so that it lands in this
                # batch's counts (a fast batch could otherwise be taken whole before the follower sees the file)
                t0 = time.monotonic()
                while not stream.partial.counts.get("partial/switches") and time.monotonic() - t0 < 120:
                    await asyncio.sleep(0.01)
                counts: dict[str, float] = {}
                got = await stream.take(step, counts)
                for key, value in counts.items():
                    total[key] = total.get(key, 0) + value
                if any(len(set(x.versions)) == 2 for group in got.collected.groups for x in group):
                    break
            await stream.close()
            await client.unload_adapter(policy.model)
            return got, total, step

    got, counts, step = asyncio.run(go())
    c = got.collected
    assert counts["partial/switches"] >= 1 and counts.get("partial/stopped_requests", 0) >= 1, (step, counts)
    assert counts["partial/resumed_requests"] >= 1
    comps = [comp for group in c.groups for comp in group]
    assert len(comps) == 4 and any(x.mask is not None and 0 in x.mask for x in comps), [x.text for x in comps]
    assert any(len(set(x.versions)) == 2 for x in comps), "a rollout must go on across the switch"
    for x in comps:
        v = np.array(x.versions)
        assert len(v) == len(x.token_ids) and (np.diff(v) >= 0).all() and set(v.tolist()) <= set(range(step + 1))
        mask = np.array(x.mask if x.mask is not None else [1] * len(v))
        env_tokens = np.flatnonzero(mask == 0)
        assert all(v[i] == v[i - 1] for i in env_tokens if i > 0)
    for group, (start, end) in zip(c.groups, c.versions, strict=True):
        assert start <= min(v for x in group for v in x.versions) and end == max(v for x in group for v in x.versions)


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """A real vLLM server on `tests.e2e.tool_env.tagged_tool_model` (the bundled model writing `<tool_call>` blocks,
    a template that renders tool turns); yields (base URL, model path)."""
    from tests.conftest import free_port, kill_group, tidal, wait_healthy
    from tests.e2e.tool_env import tagged_tool_model

    model = tagged_tool_model(tmp_path_factory.mktemp("tagged") / "model")
    port, log = free_port(), tmp_path_factory.mktemp("vllm_tool") / "infer.log"
    with open(log, "w") as f:
        proc = tidal("grpo-infer", "--infer.model", str(model), "--infer.port", str(port), stdout=f)
        try:
            wait_healthy(port, proc)
        except Exception:
            kill_group(proc)
            raise RuntimeError(log.read_text()[-3000:]) from None
        yield f"http://127.0.0.1:{port}/v1", str(model)
        kill_group(proc)


@pytest.mark.slow  # a server of its own (~30-60 s to start on 2 cores)
def test_a_tool_rollout_across_a_switch_is_the_uninterrupted_one_with_its_tool_turns_masked(tool_server, tmp_path,
                                                                                             lr0_adapter):
    """Greedy, the tool loop (`tool_group`: each `<tool_call>` turn answered by an error tool turn, up to 4 rounds)
    under `PartialTurns` with a LoRA switch while it runs: it completes with the uninterrupted rollout's tokens and
    mask, its tool turns (mask 0, logprob 0) versioned like the model token before them, its model tokens by the
    policy that sampled them (1, then 2)."""
    from tests.e2e.tool_env import TaggedReverse
    from tidal.orchestrator.partial import PartialTurns
    from tidal.orchestrator.toolloop import tool_group

    url, model = tool_server
    adapter_dir, _ = lr0_adapter
    env = TaggedReverse(max_iterations=4)
    ex = env.sample(random.Random(3))
    sampling = SamplingSection(max_tokens=400)

    async def go():
        client = VllmClient(ClientSection(base_url=[url]))
        try:
            await client.wait_ready()
            publish(tmp_path, 1, adapter_dir)
            policy = PolicyTracker(client, model, tmp_path, "tool")
            await policy.ensure(1, 60)
            switch = Switch("abort_resume", policy, merged=False)
            prompt = await client.tokenize_prompt(model, ex.prompt, env.tooling.schemas)
            whole = (await tool_group(client, policy.model, prompt, 1, sampling, 512, None, 0.0, env, ex))[0]
            switcher = asyncio.create_task(switch_when_running(switch, policy, tmp_path, adapter_dir, 0.0))
            cont = (await tool_group(client, policy.model, prompt, 1, sampling, 512, None, 0.0, env, ex,
                                     PartialTurns(switch, client, 0.0)))[0]
            await switcher
            await client.unload_adapter(policy.model)
            return whole, cont, switch
        finally:
            await client.close()

    whole, cont, switch = asyncio.run(go())
    mask, v = np.array(cont.mask), np.array(cont.versions)
    tool = np.flatnonzero(mask == 0)
    print(f"{len(cont.token_ids)} tokens, {len(tool)} of tool turns, versions {np.unique(v, return_counts=True)}, "
          f"{switch.counts}")
    assert len(tool) > 0 and tool[0] > 0, f"the model must have called the tool: {whole.text!r}"
    assert cont.token_ids == whole.token_ids and cont.mask == whole.mask and cont.finish_reason == whole.finish_reason
    assert np.array(cont.logprobs)[tool].tolist() == [0.0] * len(tool)
    assert (np.diff(v) >= 0).all() and set(v.tolist()) == {1, 2}, "the switch must land within the rollout"
    assert (v[tool] == v[tool - 1]).all(), "a tool token takes the version of the token before it"


@pytest.fixture(scope="module")
def reload_server(tmp_path_factory):
    """A real vLLM server on the bundled model that reloads merged weights in place (infer `weight_reload`)."""
    from tests.conftest import free_port, kill_group, tidal, wait_healthy

    port, log = free_port(), tmp_path_factory.mktemp("vllm_reload") / "infer.log"
    with open(log, "w") as f:
        proc = tidal("grpo-infer", "--infer.port", str(port), "--infer.weight_reload", "true", "--infer.enable_lora",
                     "false", stdout=f)
        try:
            wait_healthy(port, proc)
        except Exception:
            kill_group(proc)
            raise RuntimeError(log.read_text()[-3000:]) from None
        yield f"http://127.0.0.1:{port}/v1"
        kill_group(proc)


@pytest.mark.slow  # a server of its own (~30-60 s to start on 2 cores)
def test_merged_reload_stops_running_completions_first_and_continues_them(reload_server, tmp_path):
    """`reload: merged`: the running greedy completion is stopped before the weights are reloaded (policy 1: the
    base model's weights as the trainer merges them at learning rate 0), then continued on them: the very tokens
    of an uninterrupted completion, tokens 0 .. k from policy 0 and the rest from policy 1."""
    base = load_base_model(MODEL, torch.device("cpu"), torch.float32)
    sampling = SamplingSection(max_tokens=LONG, min_tokens=LONG)

    async def go():
        client = VllmClient(ClientSection(base_url=[reload_server]))
        try:
            await client.wait_ready()
            policy = PolicyTracker(client, MODEL, tmp_path, "unused", merged=True)
            await policy.ensure(0, 60)
            switch = Switch("abort_resume", policy, merged=True)
            prompt = await client.tokenize_text(MODEL, "reverse: hello world")
            whole = (await client.sample(MODEL, prompt, 1, LONG, 0.0, None, {"min_tokens": LONG}))[0]

            async def switcher():
                while not switch.running:
                    await asyncio.sleep(0.005)
                await asyncio.sleep(0.05)
                weights.publish(tmp_path, 1, lambda tmp: base.save_pretrained(str(tmp / "merged")))
                await switch.before_load()
                assert not switch.running and not switch.open.is_set()
                try:
                    await policy.ensure(0, 120)
                finally:
                    switch.after_load()

            task = asyncio.create_task(switcher())
            cont = await partial_completion(switch, client, prompt, LONG, sampling, 0.0, None)
            await task
            return whole, cont, policy.step
        finally:
            await client.close()

    whole, cont, served = asyncio.run(go())
    assert served == 1
    v = np.array(cont.versions)
    assert set(v.tolist()) == {0, 1} and (np.diff(v) >= 0).all(), "the reload must land mid-completion"
    assert cont.token_ids == whole.token_ids and cont.text == whole.text
    assert np.abs(np.array(cont.logprobs) - np.array(whole.logprobs)).max() < 1e-4
