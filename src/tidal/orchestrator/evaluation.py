"""Online evaluation (`eval.*`): score the served policy on fixed held-out examples between batches.

Each eval environment gets a fixed example set, drawn once with a seed of its own (so it does not move the training
sampler): `num_examples` of them, or for -1 the environment's finite eval set (`eval_examples()`) or 128 generated
ones; their prompts are rendered by the server like training prompts (the chat template with
`client.chat_template_kwargs`, `InferenceClient.tokenize_prompt`). An evaluation samples `rollouts_per_example`
completions per example from the policy vLLM serves (at the training temperature and with the training sampling
keys; multi-turn environments run their turns as in training), scores them with that environment's `reward_group`
(an environment without a reward of its own, e.g. `dataset`: with the run's reward functions, weighted as in
training, `Scorer.funcs_total`), and records per environment `eval/{name}/reward/mean`, `.../reward/std`,
`.../pass@k` for every k <= `rollouts_per_example` (the unbiased estimator, `tidal.monitor.eval_metrics`: at k =
K it is the share of examples with a completion scoring >= 1, at k = 1 the share of correct completions),
`.../completion_len/mean` (and `.../turns/mean` for a multi-turn environment), with the policy step evaluated, to
`eval.jsonl` and the metric sinks. `tidal eval` (`tidal.evaluate`) samples and scores with the same functions. The
base model (policy 0) is evaluated before the first step when `eval_base_model` is set.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import numpy as np

from tidal.config.orch import EvalSection, SamplingSection
from tidal.envs import Environment, Example
from tidal.envs.agent import AgentEnv
from tidal.envs.images import has_images, openai_messages
from tidal.inference.protocol import Completion, InferenceClient
from tidal.monitor.eval_metrics import summarize
from tidal.monitor.metrics import MetricsWriter
from tidal.orchestrator.agentloop import agent_group
from tidal.orchestrator.envmix import build_env
from tidal.orchestrator.rollout import multi_turn_group, rollout_group
from tidal.orchestrator.scoring import Scorer
from tidal.orchestrator.toolloop import tool_group

GENERATED_EVAL_SIZE = 128
EVAL_SEED = 1_000_003


def turns(mask: list[int] | None) -> int:
    """Model turns in a completion: 1 + the environment replies (runs of mask 0) followed by model tokens."""
    if not mask:
        return 1
    return 1 + sum(1 for a, b in zip(mask, mask[1:], strict=False) if a == 0 and b == 1)


def eval_env(e: Any, scorer: Scorer | None) -> Environment:
    """The eval environment of section `e`, built; one without a reward of its own needs the run's reward
    functions (`scorer`), else ValueError."""
    env = build_env(e)
    if not env.has_reward and (scorer is None or not scorer.funcs):
        raise ValueError(f"eval env '{e.name or e.id}' has no reward of its own and the run has no reward "
                         f"functions to score it with (orch reward_funcs)")
    return env


class Evaluator:
    """The eval environments, their fixed examples, and when the next evaluation is due."""

    def __init__(self, ecfg: EvalSection, sampling: SamplingSection, seq_len: int, writer: MetricsWriter,
                 scorer: Scorer | None = None) -> None:
        """`scorer`: the run's reward functions, for eval environments without a reward of their own."""
        self.ecfg, self.sampling, self.seq_len, self.writer = ecfg, sampling, seq_len, writer
        self.scorer = scorer
        self.sets: dict[str, tuple[Environment, list[Example]]] = {}
        for i, e in enumerate(ecfg.env):
            env = eval_env(e, scorer)
            finite = env.eval_examples()
            if ecfg.num_examples == -1 and finite is not None:
                examples = list(finite)
            else:
                n = GENERATED_EVAL_SIZE if ecfg.num_examples == -1 else ecfg.num_examples
                rng = random.Random(EVAL_SEED + i)
                examples = list(finite)[:n] if finite is not None else [env.sample(rng) for _ in range(n)]
            self.sets[e.name or env.id or e.id] = (env, examples)
        self.prompts: dict[str, list[list[int]]] = {}
        self.last_evaluated = -1

    def score(self, env: Environment, example: Example, group: list[Completion], step: int) -> list[float]:
        """Rewards of one group: the environment's own, or the run's reward functions' weighted total."""
        if env.has_reward:
            return list(env.score_rollouts(example, group))
        assert self.scorer is not None
        return [float(x) for x in self.scorer.funcs_total(env, example, group, step)]

    def due(self, policy_step: int) -> bool:
        """Whether `policy_step` should be evaluated: the first policy at or past the next multiple."""
        if policy_step <= self.last_evaluated:
            return False
        if policy_step == 0:
            return self.ecfg.eval_base_model
        return policy_step // self.ecfg.interval > max(self.last_evaluated, 0) // self.ecfg.interval

    def skip(self, policy_step: int) -> None:
        """Mark `policy_step` as evaluated without evaluating it (`skip_eval_on_resume`)."""
        self.last_evaluated = max(self.last_evaluated, policy_step)

    async def run(self, client: InferenceClient, model: str, base_model: str, policy_step: int, step: int,
                  temperature: float) -> dict[str, Any]:
        """Evaluate the served policy; returns (and records) the metrics."""
        t0 = time.monotonic()
        out: dict[str, Any] = {"step": step, "policy_step": policy_step}
        for name, (env, examples) in self.sets.items():
            if name not in self.prompts:
                tools = env.tooling.schemas if env.tooling is not None else None
                self.prompts[name] = list(await asyncio.gather(*(client.tokenize_prompt(base_model, ex.prompt, tools)
                                                                 for ex in examples)))
            k, seed = self.ecfg.rollouts_per_example, self.sampling.seed
            groups = await asyncio.gather(*(
                sample_group(client, model, env, p, ex, k, self.sampling, self.seq_len,
                             None if seed is None else seed + i, temperature, policy_step + 1)
                for i, (p, ex) in enumerate(zip(self.prompts[name], examples, strict=True))))
            rewards = [self.score(env, ex, g, step) for ex, g in zip(examples, groups, strict=True)]
            m = summarize(rewards, [[len(c.token_ids) for c in g] for g in groups],
                          [[c.finish_reason == "length" for c in g] for g in groups])
            out |= {f"eval/{name}/reward/mean": m["reward/mean"], f"eval/{name}/reward/std": m["reward/std"],
                    **{f"eval/{name}/{key}": m[key] for key in m if key.startswith("pass@") and "_" not in key},
                    f"eval/{name}/completion_len/mean": m["completion_len/mean"],
                    f"eval/{name}/examples": len(examples)}
            if env.max_turns > 1 or env.tooling is not None:  # model turns per rollout (one after each env reply)
                out[f"eval/{name}/turns/mean"] = float(np.mean([turns(c.mask) for g in groups for c in g]))
        out["eval/time_s"] = time.monotonic() - t0
        self.writer.write(out)
        self.last_evaluated = max(self.last_evaluated, policy_step)
        return out


async def sample_group(client: InferenceClient, model: str, env: Environment, prompt_ids: list[int], example: Example,
                       k: int, sampling: SamplingSection, seq_len: int, seed: int | None, temperature: float,
                       policy_step: int) -> list[Completion]:
    """`k` completions of one example as training samples them: the environment's own rollout function, its tool
    loop, its turns, or one request (with images through the chat API); `temperature` 0 is greedy. `policy_step`:
    the policy a rollout function is told it samples. Shared by online `eval` and `tidal eval`."""
    if env.rollout_func is not None:
        return await env.rollout_func.group(client, model, prompt_ids, k, sampling, seq_len, seed, temperature,
                                            example, policy_step)
    if isinstance(env, AgentEnv):
        return await agent_group(client, model, prompt_ids, k, sampling, seq_len, seed, temperature, env, example)
    if env.tooling is not None:
        return await tool_group(client, model, prompt_ids, k, sampling, seq_len, seed, temperature, env, example)
    if env.max_turns > 1:
        return await multi_turn_group(client, model, prompt_ids, k, sampling, seq_len, seed, temperature, env, example)
    prompt = example.prompt
    messages = openai_messages(prompt) if not isinstance(prompt, str) and has_images(prompt) else None
    return await rollout_group(client, model, prompt_ids, k, sampling, seq_len, seed, temperature, messages)
