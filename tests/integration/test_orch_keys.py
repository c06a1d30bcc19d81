"""Orchestrator keys checked against the real vLLM server that are not covered elsewhere:
`eval.skip_eval_on_resume`, `buffer.skip_verification` and `teacher.max_concurrency`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.conftest import MODEL
from tidal.config.orch import ClientSection, OrchConfig
from tidal.inference.backends.vllm.client import VllmClient
from tidal.orchestrator.loop import run

pytestmark = pytest.mark.vllm


def orch_cfg(url: str, run_dir: Path, max_steps: int, **kw) -> OrchConfig:
    return OrchConfig.model_validate({
        "output_dir": str(run_dir), "max_steps": max_steps, "max_async_level": 4, "max_off_policy_steps": 8,
        "batch_size": 4, "rollouts_per_example": 2, "seq_len": 128, "sampling": {"max_tokens": 8},
        "client": {"base_url": [url]}, "ckpt": {"interval": 1}, **kw})


def eval_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "eval.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("skip", [True, False])
def test_skip_eval_on_resume(vllm_server, tmp_path, skip):
    """No trainer: the policy stays the base model (policy 0). A fresh run evaluates it once; a resumed run
    evaluates it again right away unless `skip_eval_on_resume`."""
    ev = {"env": [{"id": "reverse-text", "name": "rev"}], "num_examples": 2, "interval": 1,
          "skip_eval_on_resume": skip}
    asyncio.run(run(orch_cfg(vllm_server, tmp_path, 1, eval=ev), tmp_path))
    assert [r["policy_step"] for r in eval_rows(tmp_path)] == [0]
    cfg = orch_cfg(vllm_server, tmp_path, 2, eval=ev)
    cfg.ckpt.resume_step = -1
    asyncio.run(run(cfg, tmp_path))
    assert (tmp_path / "rollouts" / "step_2.safetensors").exists(), "the resumed run went on"
    assert [r["policy_step"] for r in eval_rows(tmp_path)] == ([0] if skip else [0, 0])


@pytest.mark.parametrize("skip", [False, True])
def test_skip_verification_turns_scoring_off(vllm_server, tmp_path, skip):
    """reverse-text with a reward function that always gives 1: scored, the mean is >= 1; with
    `buffer.skip_verification` nothing is called and every reward is 0."""
    cfg = orch_cfg(vllm_server, tmp_path, 1, buffer={"skip_verification": skip},
                   reward_funcs=[{"import_path": "tests.integration.test_orch_keys:always_one"}])
    asyncio.run(run(cfg, tmp_path))
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    rewards = [s["reward"] for s in samples]
    assert rewards and (all(r == 0 for r in rewards) if skip else all(r >= 1 for r in rewards)), rewards


def always_one(completions, **_):
    return [1.0] * len(completions)


class CountingClient(VllmClient):
    """The real client, recording how many prompt-logprob requests are in flight at once."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.live = self.peak = 0

    async def prompt_logprobs(self, model: str, token_ids: list[int]) -> list[float]:
        self.live += 1
        self.peak = max(self.peak, self.live)
        try:
            await asyncio.sleep(0.05)  # let the other requests start if the gate allows them
            return await super().prompt_logprobs(model, token_ids)
        finally:
            self.live -= 1


@pytest.mark.parametrize("concurrency", [1, 3])
def test_teacher_max_concurrency_bounds_requests_in_flight(nccl_server, concurrency):
    """(On the server without LoRA: vLLM 0.32's CPU LoRA path crashes on concurrent prompt-logprob requests,
    which is why `max_concurrency` defaults to 1.)"""
    async def go():
        client = CountingClient(ClientSection(base_url=[nccl_server[0]]))
        try:
            seqs = [list(range(5, 15 + i)) for i in range(8)]
            out = await client.prompt_logprobs_many(MODEL, seqs, concurrency)
            return out, client.peak
        finally:
            await client.close()

    out, peak = asyncio.run(go())
    assert [len(o) for o in out] == [10 + i for i in range(8)]
    assert peak == concurrency


def collect_once(url: str, tmp_path: Path, **kw):
    import random

    from tidal.orchestrator.buffer import Buffer
    from tidal.orchestrator.collect import collect_groups
    from tidal.orchestrator.envmix import EnvMix
    from tidal.orchestrator.policy import PolicyTracker
    from tidal.orchestrator.scoring import Scorer

    cfg = orch_cfg(url, tmp_path, 1, batch_size=8, rollouts_per_example=2, **kw)
    env, buffer = EnvMix(cfg.env, cfg.buffer.env_ratios), Buffer(cfg.buffer, cfg.dynamic_sampling)

    async def go():
        client = VllmClient(ClientSection(base_url=[url]))
        try:
            policy = PolicyTracker(client, MODEL, tmp_path, "default")
            buffer.new_step()
            rng = random.Random(cfg.buffer.seed if cfg.buffer.seed is not None else cfg.seed)
            got = await collect_groups(1, cfg, env, rng, client, MODEL, policy, {}, Scorer(env.envs, cfg), buffer)
            return [ex.prompt[-1]["content"] for ex in got.examples], [[c.token_ids for c in g] for g in got.groups]
        finally:
            await client.close()

    return asyncio.run(go())


def test_seed_and_sampling_seed_make_sampling_reproducible(vllm_server, tmp_path):
    prompts, comps = collect_once(vllm_server, tmp_path, seed=7, sampling={"max_tokens": 12, "seed": 3})
    assert collect_once(vllm_server, tmp_path, seed=7, sampling={"max_tokens": 12, "seed": 3}) == (prompts, comps)
    other_prompts, _ = collect_once(vllm_server, tmp_path, seed=8, sampling={"max_tokens": 12, "seed": 3})
    assert other_prompts != prompts, "seed draws the examples"
    again_prompts, other_comps = collect_once(vllm_server, tmp_path, seed=7, sampling={"max_tokens": 12, "seed": 4})
    assert again_prompts == prompts and other_comps != comps, "sampling.seed seeds vLLM's sampling"
    buffer_prompts, _ = collect_once(vllm_server, tmp_path, seed=7, buffer={"seed": 8},
                                     sampling={"max_tokens": 12, "seed": 3})
    assert buffer_prompts == other_prompts, "buffer.seed, when set, seeds the example draw instead of seed"


def finished_requests(url: str) -> float:
    import httpx

    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def test_several_base_urls_spread_the_requests(vllm_server, nccl_server):
    """`client.base_url` with two real servers: sampling requests alternate between them."""
    urls = [vllm_server, nccl_server[0]]
    before = [finished_requests(u) for u in urls]

    async def go():
        client = VllmClient(ClientSection(base_url=urls))
        try:
            await client.wait_ready()
            prompt = await client.tokenize_chat(MODEL, [{"role": "user", "content": "abc def"}])
            return await asyncio.gather(*(client.sample(MODEL, prompt, 2, 6, 1.0, i) for i in range(10)))
        finally:
            await client.close()

    groups = asyncio.run(go())
    assert all(len(g) == 2 for g in groups)
    served = [finished_requests(u) - b for u, b in zip(urls, before, strict=True)]
    assert served == [10, 10], served  # 5 requests each; vLLM counts each of a request's 2 completions
