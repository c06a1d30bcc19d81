"""The gated mode (`async_mode: gated`): one batch at a time, behind the async gate.

`sample_step` passes the async gate (`policy.PolicyTracker.ensure`), then `collect_groups` samples the batch in
rounds (`fill.Filler`): each round draws the examples it asks for (through the buffer: no duplicates, difficulty
pools), asks for `rollouts_per_example` completions of each (all in flight at once, from server-tokenized prompt
ids; multi-turn environments run their turns, environments with tools the loop of `toolloop`), scores every group,
gives the groups with no signal more completions (orch `extend_flat_groups`, `extend`) or their reference answer
(orch `guide_flat_groups`, `guide`) and offers each to the filler, which judges it, keeps or spares it and tops the
batch up (`fill` module doc: the rule is the in-flight stream's). A step whose inference requests fail (the server
died or restarted) is sampled again once the server answers, with the same examples and the policy loaded again
(`fill.Retries`). A step that is an environment outage is waited out and sampled again (`outage`; one outage state
per run, shared with every waiter). With a `teacher`, its logprobs of every sequence come along. A prompt's images
(`tidal.envs.images`) are encoded once per group and travel with it to the batch."""

from __future__ import annotations

import random
import time
from typing import Any

from tidal.config.orch import OrchConfig
from tidal.envs.images import prompt_images
from tidal.inference.protocol import InferenceClient, InferenceError
from tidal.orchestrator.buffer import Buffer
from tidal.orchestrator.extend import extend_groups
from tidal.orchestrator.fill import Filler, Retries, with_teacher
from tidal.orchestrator.groups import Collected, Pool, StepSample, draw_prompts, group_rollouts
from tidal.orchestrator.guide import guide_groups
from tidal.orchestrator.outage import Outage
from tidal.orchestrator.policy import PolicyTracker, required_policy
from tidal.orchestrator.scoring import Scorer
from tidal.rewards import ServiceUnavailable
from tidal.transport import weights


async def collect_groups(step: int, cfg: OrchConfig, env: Any, rng: random.Random, client: InferenceClient,
                         base: str, policy: PolicyTracker, counts: dict[str, float], scorer: Scorer,
                         buffer: Buffer) -> Collected:
    """Sample and score groups in rounds until the batch is full or `max_sampling_rounds` rounds were sampled
    (`fill.Filler`); a batch still short is topped up with rejected groups, then counted in `env/short_groups`."""
    filler = Filler(cfg, buffer, scorer.weights)
    while not filler.kept.env.is_outage(cfg.env_outage.fraction) and (ask := filler.next_round()):
        examples, prompts = await draw_prompts(env, rng, client, base, ask, cfg, counts, buffer)
        images = [prompt_images(ex.prompt) for ex in examples]
        groups = await group_rollouts(step, cfg, env, client, policy.model, examples, prompts, filler.scored, images)
        scores = [scorer.score(ex, g, step) for ex, g in zip(examples, groups, strict=True)]
        pools: list[Pool | None] = [None] * len(groups)
        if cfg.extend_flat_groups:  # more completions for the groups with no signal (`extend`)
            groups, scores, pools = await extend_groups(step, cfg, env, client, policy.model, examples, prompts,
                                                        groups, scores, images, scorer, filler.scored, counts)
        if cfg.guide_count():  # the reference answer in the groups still without signal (`guide`)
            groups, scores, pools = await guide_groups(step, cfg, client, policy.model, base, examples, prompts,
                                                       groups, scores, pools, images, scorer, counts)
        for ex, p, g, s, im, pool in zip(examples, prompts, groups, scores, images, pools, strict=True):
            p = g[0].prompt_ids or p  # an environment's reset observation changed the prompt
            version = (policy.step, policy.step)  # gated: the whole batch is sampled by the one served policy
            filler.offer(ex, p, g, s, im, version, pool)
    filler.top_up()
    if not filler.kept.env.is_outage(cfg.env_outage.fraction):
        filler.shortfall(counts, f"batch {step}")
    return filler.kept


def policy_ready(policy: PolicyTracker) -> dict[str, float]:
    """`timing/policy_ready_s`: seconds from the newly served policy's `STABLE` marker to now, ready to sample
    (the hand-over of a policy: the orchestrator's poll, vLLM's reload and the identity check); none for the base."""
    stamp = weights.policy_stamp(policy.run_dir, policy.step) if policy.step else 0
    return {"timing/policy_ready_s": max(0.0, time.time() - stamp / 1e9)} if stamp else {}


async def sample_step(step: int, cfg: OrchConfig, env: Any, rng: random.Random, client: InferenceClient,
                      base: str, policy: PolicyTracker, counts: dict[str, float],
                      teacher: InferenceClient | None, first_after_resume: bool = False,
                      scorer: Scorer | None = None, buffer: Buffer | None = None,
                      outage: Outage | None = None) -> StepSample:
    """Prompts, completions, scores (and teacher logprobs) of batch `step`. A failed request (the server died
    or restarted) is retried after the server answers again, with the same examples and the policy reloaded; an
    environment outage (`outage`: most rollouts failed on the environment's side, or drawing the examples did) is
    waited out and the step sampled again with the same examples (`env/outage_waits`: the waits of this step);
    `outage`: the run's outage state (one per run; a fresh one when not given).
    The first step after a resume waits `ckpt.wait_for_weights_timeout` (if set) for its policy."""
    state = rng.getstate()
    timeout = cfg.weights_timeout_s
    if first_after_resume and cfg.ckpt.wait_for_weights_timeout:
        timeout = cfg.ckpt.wait_for_weights_timeout
    buffer = buffer or Buffer(cfg.buffer, cfg.dynamic_sampling)
    outage = outage or Outage(cfg.env_outage, env)
    retries, waits0 = Retries(f"step {step}", policy, client, teacher), outage.waits
    while True:
        counts["env/outage_waits"] = float(outage.waits - waits0)
        try:
            if await client.discover():
                policy.invalidate()  # servers joined the elastic pool: load the policy on all of them
            served = policy.step
            waited = await policy.ensure(required_policy(step, cfg.max_async_level), timeout)
            t0 = time.monotonic()
            if policy.step != served:
                counts |= policy_ready(policy)
            buffer.new_step()
            assert scorer is not None
            got = await collect_groups(step, cfg, env, rng, client, base, policy, counts, scorer, buffer)
            if outage.settle(got.env):
                await outage.wait(f"step {step}: {got.env.describe()}")
                rng.setstate(state)
                continue
            return await with_teacher(StepSample(got, waited, time.monotonic() - t0), cfg, teacher)
        except ServiceUnavailable as exc:  # an environment could not draw the step's examples
            await outage.wait(f"step {step}: drawing its examples failed: {exc}")
            rng.setstate(state)
        except InferenceError as exc:
            await retries.failed(exc, counts)
            rng.setstate(state)

