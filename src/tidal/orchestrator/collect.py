"""Collecting the groups of one batch: examples -> prompt ids -> completions -> scores.

`sample_step` passes the async gate (`policy.PolicyTracker.ensure`), then `collect_groups` draws `batch_size /
rollouts_per_example` examples (through the buffer: no duplicates, difficulty pools), asks for
`rollouts_per_example` completions of each (all in flight at once, from server-tokenized prompt ids; multi-turn
environments run their turns, environments with tools the loop of `toolloop`) and scores every group. With group
filters (dynamic sampling, online difficulty filtering) it samples `oversampling_factor` x the groups still missing,
over up to `max_sampling_rounds` rounds, and tops the batch up with rejected groups if it is still short. A step
whose inference requests fail (the server died or restarted) is sampled again once the server answers, with the same
examples and the policy loaded again. A group left with fewer than 2 rollouts the environment judged is dropped, and
a step that is an environment outage is waited out and sampled again (`outage`). With a `teacher`, its logprobs of
every sequence come along. A prompt's images (`tidal.envs.images`) are encoded once per group and travel with it to
the batch."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tidal.config.orch import OrchConfig, TeacherSection
from tidal.envs.base import Example
from tidal.envs.images import count_images, has_images, openai_messages, prompt_images, text_of
from tidal.inference.protocol import Completion, InferenceClient, InferenceError, NotMultimodal
from tidal.orchestrator.advantage import combine_rewards
from tidal.orchestrator.buffer import Buffer
from tidal.orchestrator.envmix import EnvMix
from tidal.orchestrator.outage import EnvFailures, Outage, judged
from tidal.orchestrator.policy import PolicyTracker, required_policy
from tidal.orchestrator.rollout import multi_turn_group, rollout_group
from tidal.orchestrator.sampling import temperature_at
from tidal.orchestrator.scoring import Scorer
from tidal.orchestrator.toolloop import tool_group
from tidal.rewards import ServiceUnavailable

log = logging.getLogger("tidal.orch")

MAX_DRAWS = 100
MAX_ATTEMPTS = 5


async def tokenize_example(client: InferenceClient, model: str, example: Example,
                           tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The example's prompt token ids (with its tools' schemas); an image prompt to a text-only model raises
    NotMultimodal naming it."""
    try:
        return await client.tokenize_prompt(model, example.prompt, tools)
    except NotMultimodal as exc:
        user = [text_of(m.get("content")) for m in example.prompt if m.get("role") == "user"] \
            if not isinstance(example.prompt, str) else [example.prompt]
        raise NotMultimodal(f"{exc}; the example of environment '{example.task or '?'}' with "
                            f"{count_images(example.prompt)} image(s): {(user or [''])[-1][:80]!r}") from None


async def draw_prompts(env: Any, rng: random.Random, client: InferenceClient, model: str, n: int,
                       cfg: OrchConfig, counts: dict[str, float],
                       buffer: Buffer | None = None) -> tuple[list[Example], list[list[int]]]:
    """`n` examples (through `buffer`, when given: no duplicates, no pooled examples) and their prompt token
    ids. A prompt leaving no room under `seq_len` is skipped (another example is drawn) or truncated to its
    last tokens, per `long_prompts` (a prompt with images is always skipped: cutting it could split an image's
    placeholder tokens); counted in `counts`."""
    def draw() -> Example:
        return buffer.draw(env, rng) if buffer is not None else env.sample(rng)

    def tokenize(ex: Example) -> Any:
        return tokenize_example(client, model, ex, tool_schemas(env, ex))

    examples = [draw() for _ in range(n)]
    prompts = list(await asyncio.gather(*(tokenize(ex) for ex in examples)))
    reserve = min(cfg.sampling.max_tokens or max(1, cfg.seq_len // 4), cfg.seq_len // 2)
    for i in range(n):
        draws = 0
        while len(prompts[i]) >= cfg.seq_len:
            if cfg.long_prompts == "truncate" and not has_images(examples[i].prompt):
                prompts[i] = prompts[i][-(cfg.seq_len - reserve):]
                counts["prompts/truncated"] = counts.get("prompts/truncated", 0.0) + 1
                break
            counts["prompts/skipped"] = counts.get("prompts/skipped", 0.0) + 1
            draws += 1
            if draws >= MAX_DRAWS:
                raise ValueError(f"{MAX_DRAWS} examples in a row were longer than seq_len {cfg.seq_len} tokens; "
                                 f"raise seq_len or set long_prompts: truncate")
            examples[i] = draw()
            prompts[i] = await tokenize(examples[i])
    return examples, prompts


def tool_schemas(env: Any, example: Example) -> list[dict[str, Any]] | None:
    """The JSON schemas of the tools of `example`'s environment (rendered into its prompt), or None."""
    e = env.env_of(example) if isinstance(env, EnvMix) else env
    return e.tooling.schemas if getattr(e, "tooling", None) is not None else None


@dataclass
class Collected:
    """The groups chosen for one batch, with their scores."""

    examples: list[Example] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    groups: list[list[Completion]] = field(default_factory=list)
    per_func: list[np.ndarray] = field(default_factory=list)
    """(G, K) rewards per reward function of each group."""
    images: list[list[bytes]] = field(default_factory=list)
    """PNG bytes of each group's prompt images, in placeholder order (empty: a text prompt)."""
    versions: list[tuple[int, int]] = field(default_factory=list)
    """(start, end) policy versions that produced each group (`staleness` module doc)."""
    env: EnvFailures = field(default_factory=EnvFailures)
    """Failures on the environment's side among every group scored for the batch (`outage`)."""

    def add(self, example: Example, prompt: list[int], group: list[Completion], scores: np.ndarray,
            images: list[bytes] | None = None, version: tuple[int, int] = (0, 0)) -> None:
        self.examples.append(example)
        self.prompts.append(prompt)
        self.groups.append(group)
        self.per_func.append(scores)
        self.images.append(images or [])
        self.versions.append(version)

    def extend(self, other: Collected, limit: int) -> None:
        """Take the first `limit` groups of `other`."""
        for i in range(min(limit, len(other.examples))):
            self.add(other.examples[i], other.prompts[i], other.groups[i], other.per_func[i], other.images[i],
                     other.versions[i])


async def group_rollouts(step: int, cfg: OrchConfig, env: Any, client: InferenceClient, model: str,
                    examples: list[Example], prompts: list[list[int]], first_seed: int,
                    images: list[list[bytes]]) -> list[list[Completion]]:
    """One group of `rollouts_per_example` completions per prompt, all in flight at once (prompts with
    `images` through the chat API)."""
    seeds = [None if cfg.sampling.seed is None else cfg.sampling.seed + step * 100003 + first_seed + i
             for i in range(len(examples))]
    envs = [env.env_of(ex) if isinstance(env, EnvMix) else env for ex in examples]
    k, temp, sp = cfg.rollouts_per_example, temperature_at(cfg.sampling, cfg.max_steps, step), cfg.sampling
    for e, im in zip(envs, images, strict=True):
        if im and e.tooling is not None:
            raise ValueError(f"environment '{e.id}' calls tools and its prompt holds images; the tool loop samples "
                             "from token ids, without the images: tidal samples prompts with images single-turn only")
    return list(await asyncio.gather(*(
        tool_group(client, model, p, k, sp, cfg.seq_len, s, temp, e, ex) if e.tooling is not None else
        multi_turn_group(client, model, p, k, sp, cfg.seq_len, s, temp, e, ex) if e.max_turns > 1 else
        rollout_group(client, model, p, k, sp, cfg.seq_len, s, temp,
                      openai_messages(ex.prompt, im) if im and not isinstance(ex.prompt, str) else None)
        for p, s, e, ex, im in zip(prompts, seeds, envs, examples, images, strict=True))))


async def collect_groups(step: int, cfg: OrchConfig, env: Any, rng: random.Random, client: InferenceClient,
                         base: str, policy: PolicyTracker, counts: dict[str, float], scorer: Scorer,
                         buffer: Buffer) -> Collected:
    """Sample and score groups until the batch is full: one round without group filters; with them, rounds
    that ask for `oversampling_factor` x the groups still needed, keeping those the buffer accepts."""
    need = cfg.batch_size // cfg.rollouts_per_example
    kept, spare = Collected(), Collected()
    requests = 0
    for _ in range(cfg.max_sampling_rounds if buffer.filtering else 1):
        buffer.counts["buffer/rounds"] += 1
        missing = need - len(kept.examples)
        ask = math.ceil(missing * cfg.oversampling_factor) if buffer.filtering else missing
        examples, prompts = await draw_prompts(env, rng, client, base, ask, cfg, counts, buffer)
        images = [prompt_images(ex.prompt) for ex in examples]
        groups = await group_rollouts(step, cfg, env, client, policy.model, examples, prompts, requests, images)
        requests += len(examples)
        for ex, p, g, im in zip(examples, prompts, groups, images, strict=True):
            p = g[0].prompt_ids or p  # an environment's reset observation changed the prompt
            scores = scorer.score(ex, g, step)
            if not kept.env.add(g):  # fewer than 2 rollouts judged (the others failed on the environment's side)
                continue
            ok = buffer.judge(ex, combine_rewards(scores, scorer.weights)[0][judged(g)])
            if not ok:
                buffer.counts["buffer/dropped_groups"] += 1
            version = (policy.step, policy.step)  # gated: the whole batch is sampled by the one served policy
            (kept if ok and len(kept.examples) < need else spare).add(ex, p, g, scores, im, version)
        if len(kept.examples) >= need:
            break
    fill = need - len(kept.examples)
    if fill > 0:  # still short: top up with dropped groups so the batch keeps its size
        buffer.counts["buffer/filled_with_dropped"] += fill
        kept.extend(spare, fill)
    return kept


@dataclass
class StepSample:
    """Everything sampled for one batch, before advantages and assembly."""

    collected: Collected
    waited_s: float
    """Seconds the async gate waited for a new enough policy."""
    rollout_time_s: float
    teacher: list[list[float]] | None = None
    """Teacher logprobs per sequence (prompt + completion), when a teacher is configured."""
    teacher_time_s: float = 0.0
    dropped_stale: tuple[int, int] = (0, 0)
    """(samples, groups) dropped as staler than `max_off_policy_steps` while filling this batch (in-flight)."""


async def teacher_logprobs(teacher: InferenceClient, section: TeacherSection, got: Collected) -> list[list[float]]:
    """orch `teacher`'s logprobs of every sampled sequence (prompt + completion)."""
    if any(got.images):
        raise ValueError("orch teacher: teacher logprobs of prompts with images are not supported (vLLM's "
                         "prompt_logprobs take token ids without the images); drop `teacher` or the images")
    seqs = [p + c.token_ids for p, comps in zip(got.prompts, got.groups, strict=True) for c in comps]
    return await teacher.prompt_logprobs_many(section.model, seqs, section.max_concurrency)


async def sample_step(step: int, cfg: OrchConfig, env: Any, rng: random.Random, client: InferenceClient,
                      base: str, policy: PolicyTracker, counts: dict[str, float],
                      teacher: InferenceClient | None, first_after_resume: bool = False,
                      scorer: Scorer | None = None, buffer: Buffer | None = None) -> StepSample:
    """Prompts, completions, scores (and teacher logprobs) of batch `step`. A failed request (the server died
    or restarted) is retried after the server answers again, with the same examples and the policy reloaded; an
    environment outage (`outage`: most rollouts failed on the environment's side, or drawing the examples did) is
    waited out and the step sampled again with the same examples (`env/outage_waits`).
    The first step after a resume waits `ckpt.wait_for_weights_timeout` (if set) for its policy."""
    state = rng.getstate()
    timeout = cfg.weights_timeout_s
    if first_after_resume and cfg.ckpt.wait_for_weights_timeout:
        timeout = cfg.ckpt.wait_for_weights_timeout
    buffer = buffer or Buffer(cfg.buffer, cfg.dynamic_sampling)
    outage, failures = Outage(cfg.env_outage, env), 0
    while True:
        counts["env/outage_waits"] = float(outage.waits)
        try:
            if await client.discover():
                policy.invalidate()  # servers joined the elastic pool: load the policy on all of them
            waited = await policy.ensure(required_policy(step, cfg.max_async_level), timeout)
            t0 = time.monotonic()
            buffer.new_step()
            assert scorer is not None
            got = await collect_groups(step, cfg, env, rng, client, base, policy, counts, scorer, buffer)
            if got.env.is_outage(cfg.env_outage.fraction):
                await outage.wait(f"step {step}: {got.env.describe()}")
                rng.setstate(state)
                continue
            outage.clear()
            out = StepSample(got, waited, time.monotonic() - t0)
            if teacher is not None and cfg.teacher is not None:
                t1 = time.monotonic()
                out.teacher = await teacher_logprobs(teacher, cfg.teacher, got)
                out.teacher_time_s = time.monotonic() - t1
            return out
        except ServiceUnavailable as exc:  # an environment could not draw the step's examples
            await outage.wait(f"step {step}: drawing its examples failed: {exc}")
            rng.setstate(state)
        except InferenceError as exc:
            failures += 1
            if failures == MAX_ATTEMPTS:
                raise
            log.warning("step %d: inference request failed (%s); waiting for the server, then retrying the "
                        "step (attempt %d of %d)", step, str(exc)[:300], failures + 1, MAX_ATTEMPTS)
            rng.setstate(state)
            for c in (client, teacher):
                if c is not None:
                    await c.wait_ready()
            policy.invalidate()
            counts["inference_retries"] = counts.get("inference_retries", 0.0) + 1

