"""Online evaluation (`eval.*`): score the served policy on fixed held-out examples between batches.

Each eval environment gets a fixed example set, drawn once with a seed of its own (so it does not move the training
sampler): `num_examples` of them, or for -1 the environment's finite eval set (`eval_examples()`) or 128 generated
ones; their prompts are rendered by the server like training prompts (the chat template with
`client.chat_template_kwargs`, `InferenceClient.tokenize_prompt`). An evaluation samples `rollouts_per_example`
completions per example from the policy vLLM serves (at the training temperature and with the training sampling
keys; multi-turn environments run their turns as in training), scores them with that environment's `reward_group`
(an environment without a reward of its own, e.g. `dataset`: with the run's reward functions, weighted as in
training, `Scorer.funcs_total`), and records per environment `eval/{name}/reward/mean`, `.../reward/std`,
`.../pass@k` (share of examples with a completion scoring >= 1), `.../completion_len/mean` (and `.../turns/mean`
for a multi-turn environment), with the policy step evaluated, to `eval.jsonl` and the metric sinks. The base model
(policy 0) is evaluated before the first step when `eval_base_model` is set.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import numpy as np

from tidal.config.orch import EvalSection, SamplingSection
from tidal.envs import Environment, Example
from tidal.envs.images import has_images, openai_messages
from tidal.inference.protocol import Completion, InferenceClient
from tidal.monitor.metrics import MetricsWriter
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
            k, seed, sp, n = self.ecfg.rollouts_per_example, self.sampling.seed, self.sampling, self.seq_len
            groups = await asyncio.gather(*(
                env.rollout_func.group(client, model, p, k, sp, n, None if seed is None else seed + i, temperature, ex,
                                       policy_step + 1) if env.rollout_func is not None else
                tool_group(client, model, p, k, sp, n, None if seed is None else seed + i, temperature, env, ex)
                if env.tooling is not None else
                multi_turn_group(client, model, p, k, sp, n, None if seed is None else seed + i, temperature, env,
                                 ex) if env.max_turns > 1 else
                rollout_group(client, model, p, k, sp, n, None if seed is None else seed + i, temperature,
                              openai_messages(ex.prompt) if not isinstance(ex.prompt, str) and has_images(ex.prompt)
                              else None)
                for i, (p, ex) in enumerate(zip(self.prompts[name], examples, strict=True))))
            rewards = np.array([self.score(env, ex, g, step) for ex, g in zip(examples, groups, strict=True)])
            lengths = [len(c.token_ids) for g in groups for c in g]
            out |= {f"eval/{name}/reward/mean": float(rewards.mean()), f"eval/{name}/reward/std": float(rewards.std()),
                    f"eval/{name}/pass@{self.ecfg.rollouts_per_example}": float((rewards.max(axis=1) >= 1).mean()),
                    f"eval/{name}/completion_len/mean": float(np.mean(lengths)),
                    f"eval/{name}/examples": len(examples)}
            if env.max_turns > 1 or env.tooling is not None:  # model turns per rollout (one after each env reply)
                out[f"eval/{name}/turns/mean"] = float(np.mean([turns(c.mask) for g in groups for c in g]))
        out["eval/time_s"] = time.monotonic() - t0
        self.writer.write(out)
        self.last_evaluated = max(self.last_evaluated, policy_step)
        return out
