"""What both rollout modes share: drawing examples and their prompt ids, sampling one group, the records a batch
is made of (`Collected`, `StepSample`) and teacher logprobs. The gated mode (`collect`) and the in-flight stream
(`stream`) differ only in how they launch groups; both hand the scored groups to one filler (`fill`).

Seeds: with `sampling.seed`, the group (or completion) numbered `index` among those launched for batch `step`
gets `sampling.seed + step * 100003 + index` (`sample_seed`); one group asked as a single request of
`rollouts_per_example` completions takes one index, a group split into one request per completion takes one per
completion."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tidal.config.orch import OrchConfig, SamplingSection, TeacherSection
from tidal.envs.agent import AgentEnv
from tidal.envs.base import Example
from tidal.envs.images import count_images, has_images, openai_messages, text_of
from tidal.inference.protocol import Completion, InferenceClient, NotMultimodal
from tidal.orchestrator.agentloop import agent_group
from tidal.orchestrator.buffer import Buffer
from tidal.orchestrator.envmix import EnvMix
from tidal.orchestrator.outage import EnvFailures
from tidal.orchestrator.rollout import Turns, multi_turn_group, rollout_group
from tidal.orchestrator.sampling import temperature_at
from tidal.orchestrator.toolloop import tool_group

MAX_DRAWS = 100
STEP_SEED_STRIDE = 100003


def sample_seed(sampling: SamplingSection, step: int, index: int) -> int | None:
    """The sampling seed of request `index` of batch `step` (module doc); None without `sampling.seed`."""
    return None if sampling.seed is None else sampling.seed + step * STEP_SEED_STRIDE + index


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


@dataclass(frozen=True)
class Pool:
    """A group trained on completions chosen from a larger pool (orch `extend_flat_groups`, `extend`): what its
    advantages and `reward/sampled_mean` need of the pool."""

    mean: float
    """Mean of the pooled judged rewards: the group's baseline."""
    std: float
    """Their unbiased std (0 for fewer than 2): the `scale_rewards: group` scale."""
    size: int
    """Judged completions pooled."""
    first_mean: float
    """Mean of the first draw's judged rewards (the `rollouts_per_example` sampled before any extension)."""


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
    pools: list[Pool | None] = field(default_factory=list)
    """Each group's pool when it was chosen from more completions (orch `extend_flat_groups`); None: as sampled."""

    def add(self, example: Example, prompt: list[int], group: list[Completion], scores: np.ndarray,
            images: list[bytes] | None = None, version: tuple[int, int] = (0, 0), pool: Pool | None = None) -> None:
        self.examples.append(example)
        self.prompts.append(prompt)
        self.groups.append(group)
        self.per_func.append(scores)
        self.images.append(images or [])
        self.versions.append(version)
        self.pools.append(pool)

    def extend(self, other: Collected, limit: int) -> None:
        """Take the first `limit` groups of `other`."""
        for i in range(min(limit, len(other.examples))):
            self.add(other.examples[i], other.prompts[i], other.groups[i], other.per_func[i], other.images[i],
                     other.versions[i], other.pools[i])


async def group_rollouts(step: int, cfg: OrchConfig, env: Any, client: InferenceClient, model: str,
                    examples: list[Example], prompts: list[list[int]], first_seed: int,
                    images: list[list[bytes]], turns: Turns | None = None) -> list[list[Completion]]:
    """One group of `rollouts_per_example` completions per prompt, all in flight at once (prompts with
    `images` through the chat API; an environment's `rollout_func`: the user's function samples the group).
    `turns`: how multi-turn and tool rollouts sample their model turns (`rollout.Turns`; default: one request
    per turn on `model`; orch `partial_rollouts`: `tidal.orchestrator.partial.PartialTurns`)."""
    seeds = [sample_seed(cfg.sampling, step, first_seed + i) for i in range(len(examples))]
    envs = [env.env_of(ex) if isinstance(env, EnvMix) else env for ex in examples]
    k, temp, sp = cfg.rollouts_per_example, temperature_at(cfg.sampling, cfg.max_steps, step), cfg.sampling
    for e, im in zip(envs, images, strict=True):
        if im and e.tooling is not None:
            raise ValueError(f"environment '{e.id}' calls tools and its prompt holds images; the tool loop samples "
                             "from token ids, without the images: tidal samples prompts with images single-turn only")
    return list(await asyncio.gather(*(
        e.rollout_func.group(client, model, p, k, sp, cfg.seq_len, s, temp, ex, step, cfg.max_steps)
        if e.rollout_func is not None else
        agent_group(client, model, p, k, sp, cfg.seq_len, s, temp, e, ex, turns) if isinstance(e, AgentEnv) else
        tool_group(client, model, p, k, sp, cfg.seq_len, s, temp, e, ex, turns) if e.tooling is not None else
        multi_turn_group(client, model, p, k, sp, cfg.seq_len, s, temp, e, ex, turns) if e.max_turns > 1 else
        rollout_group(client, model, p, k, sp, cfg.seq_len, s, temp,
                      openai_messages(ex.prompt, im) if im and not isinstance(ex.prompt, str) else None)
        for p, s, e, ex, im in zip(prompts, seeds, envs, examples, images, strict=True))))


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
    seqs = [p + x.token_ids for prompt, comps in zip(got.prompts, got.groups, strict=True) for c in comps
            for p, x in c.training_rows(prompt)]  # every training row, in the batch's order
    return await teacher.prompt_logprobs_many(section.model, seqs, section.max_concurrency)
