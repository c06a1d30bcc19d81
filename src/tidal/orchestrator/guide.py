"""Reference-answer guidance for groups with no learning signal (orch `guide_flat_groups`; gated batches).

A group whose judged rewards all agree trains on nothing. When every completion of a group failed and its example
carries a reference answer (`Example.answer`), LUFFY (Yan et al. 2025, "Learning to Reason under Off-Policy
Guidance") trains on the reference next to the model's own tries. `guide_groups` builds the reference completion
of such a group: orch `guide_template` with `{answer}` and the example's `info` fields filled in (`fill_template`),
or, without a template, the environment's own `reference_completion` (`reference_text`), tokenized by the server
without special tokens, then the model's EOS token (`reference_eos`: generation_config.json's,
else config.json's, the token vLLM stops at), scores it with the run's reward functions and, where it scores higher
than the group, puts it in place of the group's last `guide_flat_groups` completions. Its logprobs are the served
policy's (vLLM's prompt logprobs of the prompt and those tokens, untempered: the config refuses other temperatures
and truncations), so the trainer's importance ratio treats it as a completion the sampler could have drawn. The
group's advantages are those of the trained group (a `groups.Pool` of its own mean and unbiased std, so
`scale_rewards: group` gives the usual values) and its `Pool.first_mean` is the sampled group's reward:
`reward/sampled_mean` is the policy's reward, not raised by the references.

Skipped, counted and said once: an example without an answer (`guide/no_answer`) or whose environment writes no
reference completion (`guide/no_reference`), a reference that scores what the group does (`guide/no_gain`: a group
that solves its prompt already, or a template that does not satisfy the reward) or lower (`guide/not_better`), one
over `sampling.max_tokens` or `seq_len` (`guide/too_long`), a prompt with images (`guide/images`: prompt logprobs
are taken from token ids). Counted per batch: `guide/groups` (groups guided) and `guide/completions` (reference
completions trained). Groups chosen from a pool (orch `extend_flat_groups`) are left as they are.

`guide_flat_groups: auto` (the default) is resolved when the orchestrator starts (`resolved`, once the served
base model is known): 1 where every training environment writes worked reference answers
(`Environment.worked_reference`) and the run meets guidance's needs (`OrchConfig.guide_conflict`, `unfit`, the
model's EOS), else 0; the choice and its reason are logged. Never a refusal: an explicit number is refused where
the run does not meet it (the config, `preflight.check_guide`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from pathlib import Path

import numpy as np

from tidal.config.orch import OrchConfig
from tidal.envs.agent import AgentEnv
from tidal.envs.base import Environment, Example
from tidal.inference.protocol import Completion, InferenceClient
from tidal.models.config import model_config, text_config
from tidal.models.sources import resolve_model
from tidal.orchestrator.advantage import combine_rewards
from tidal.orchestrator.extend import is_flat
from tidal.orchestrator.groups import Pool
from tidal.orchestrator.outage import judged
from tidal.orchestrator.scoring import Scorer

log = logging.getLogger("tidal.orch")
_SAID: set[str] = set()
WHY = {"no_answer": "its example has no reference answer",
       "no_gain": "its reference completion scores what the group does (a group that solves its prompt already; "
                  "if no group is ever guided, does orch guide_template write the answer as the reward wants it?)",
       "not_better": "its reference completion scores lower than the group (does orch guide_template "
                     "write the answer as the reward wants it?)",
       "too_long": "its reference completion is longer than sampling.max_tokens or leaves no room under seq_len",
       "images": "its prompt holds images (reference logprobs are taken from token ids)",
       "no_reference": "orch guide_template is not set and its environment writes no reference completion"}


@functools.cache
def reference_eos(model: str) -> int:
    """The EOS token id of `model` (a config's model name), which ends a reference completion: the first of
    generation_config.json's `eos_token_id`, else config.json's (and its `text_config`'s). ValueError when the
    model directory has none."""
    folder = Path(resolve_model(model))
    gen = folder / "generation_config.json"  # the house reads config.json (`tidal.models.config`), not this one
    config = model_config(str(folder), missing_ok=True)
    candidates = [json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None,
                  config.get("eos_token_id"), text_config(config).get("eos_token_id")]
    for eos in candidates:
        if isinstance(eos, list) and eos:
            eos = eos[0]
        if isinstance(eos, int):
            return eos
    raise ValueError(f"guide_flat_groups: model '{model}' ({folder}) names no eos_token_id in generation_config.json "
                     f"or config.json, which ends a reference completion; set guide_flat_groups: 0")


def unfit(env: Environment) -> str:
    """Why reference-answer guidance cannot serve `env` ("": it can): a reference answer is one completion of one
    turn, which an environment with a rollout function, tools, an agent program or several turns does not train."""
    return ("a rollout function" if env.rollout_func is not None else "tools" if env.tooling is not None else
            "an agent program" if isinstance(env, AgentEnv) else
            f"{env.max_turns} turns" if env.max_turns > 1 else "")


def auto_off(cfg: OrchConfig, envs: dict[str, Environment], base: str) -> str | None:
    """Why `guide_flat_groups: auto` resolves to 0 for this run (None: it resolves to 1)."""
    if plain := [name for name, e in envs.items() if not e.worked_reference]:
        return f"env {', '.join(plain)} writes no worked reference answers (Environment.worked_reference)"
    if why := cfg.guide_conflict(1):
        return why
    if kinds := [f"env '{name}' has {kind}" for name, e in envs.items() if (kind := unfit(e))]:
        return f"{'; '.join(kinds)}, and a reference answer is one completion of one turn"
    try:
        reference_eos(base)
    except ValueError as exc:
        return str(exc)
    return None


def resolved(cfg: OrchConfig, envs: dict[str, Environment], base: str) -> OrchConfig:
    """`cfg` with `guide_flat_groups: auto` resolved for the run's training environments and served base model
    `base` (1 where every environment writes worked references and the run allows guidance, else 0), the choice said
    once; any other value as it is."""
    if cfg.guide_flat_groups != "auto":
        return cfg
    why = auto_off(cfg, envs, base)
    if why is None:
        log.info("reference-answer guidance on (orch guide_flat_groups auto: env %s writes worked reference answers; "
                 "a group whose completions all fail trains on one; guide_flat_groups: 0 turns it off)",
                 ", ".join(envs))
    else:
        log.info("reference-answer guidance off (orch guide_flat_groups auto): %s", why)
    return cfg.model_copy(update={"guide_flat_groups": 0 if why else 1})


def _skip(reason: str, example: Example, counts: dict[str, float]) -> None:
    """Count a flat group left unguided (`guide/<reason>`) and say so once per reason."""
    counts[f"guide/{reason}"] = counts.get(f"guide/{reason}", 0.0) + 1
    if reason not in _SAID:
        _SAID.add(reason)
        log.warning("guide_flat_groups: a flat group of environment '%s' is not guided: %s (counted in guide/%s; "
                    "said once)", example.task or "?", WHY[reason], reason)


def fill_template(template: str, example: Example) -> str:
    """orch `guide_template` with `{answer}` and the example's `info` fields (`{a}`, ...) filled in (str.format
    rules: `{{` for a brace); ValueError naming a field the example lacks."""
    try:
        return template.format_map({**example.info, "answer": example.answer})
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"orch guide_template {template!r}: {exc!r} for an example of environment "
                         f"'{example.task or '?'}', whose fields are answer and {sorted(example.info) or 'no info'}"
                         ) from None


def reference_text(cfg: OrchConfig, envs: dict[str, Environment], example: Example) -> str | None:
    """The reference completion's text: orch `guide_template` filled in, else the example's environment's
    `reference_completion` (None when it has none)."""
    if cfg.guide_template is not None:
        return fill_template(cfg.guide_template, example)
    env = envs.get(example.task) or (next(iter(envs.values())) if len(envs) == 1 else None)
    try:
        return env.reference_completion(example) if env is not None else None
    except NotImplementedError:
        return None


async def reference(cfg: OrchConfig, client: InferenceClient, model: str, base: str, example: Example,
                    prompt: list[int], counts: dict[str, float], envs: dict[str, Environment]) -> Completion | None:
    """`example`'s reference completion (module doc) without its logprobs yet, or None when it is too long or its
    environment writes none (counted); `base`: the served base model (its EOS ends the completion)."""
    text = reference_text(cfg, envs, example)
    if text is None:
        _skip("no_reference", example, counts)
        return None
    ids = [*await client.tokenize_text(model, text), reference_eos(base)]
    budget = min(cfg.sampling.max_tokens or cfg.seq_len, cfg.seq_len - len(prompt))
    if len(ids) > budget:
        _skip("too_long", example, counts)
        return None
    return Completion(ids, [], text, "stop", prompt_ids=None)


async def with_logprobs(client: InferenceClient, model: str, ref: Completion, prompt: list[int]) -> Completion:
    """`ref` with the served policy `model`'s logprobs of its tokens after `prompt` (vLLM's prompt logprobs)."""
    ref.logprobs = (await client.prompt_logprobs(model, [*prompt, *ref.token_ids]))[len(prompt):]
    return ref


async def guide_groups(step: int, cfg: OrchConfig, client: InferenceClient, model: str, base: str,
                       examples: list[Example], prompts: list[list[int]], groups: list[list[Completion]],
                       scores: list[np.ndarray], pools: list[Pool | None], images: list[list[bytes]], scorer: Scorer,
                       counts: dict[str, float]) -> tuple[list[list[Completion]], list[np.ndarray], list[Pool | None]]:
    """The round's groups, scores and pools with every flat group guided where its reference scores higher
    (module doc; a round's references are tokenized at once, scored, and those that score higher get their
    logprobs at once). `prompts`: the prompt ids each group continues; `model`: the served policy's name; `base`:
    the served base model's."""
    out_groups, out_scores, out_pools = list(groups), [np.asarray(s) for s in scores], list(pools)
    n, todo = cfg.guide_count(), []
    for i, (ex, g) in enumerate(zip(examples, groups, strict=True)):
        rewards, ok = combine_rewards(out_scores[i], scorer.weights)[0], judged(g)
        if pools[i] is not None or not is_flat(rewards, ok) or not ok.all():
            continue
        if reason := "no_answer" if not ex.answer else "images" if images[i] else None:
            _skip(reason, ex, counts)
        else:
            todo.append(i)
    prompt = {i: groups[i][0].prompt_ids or prompts[i] for i in todo}
    refs = await asyncio.gather(*(reference(cfg, client, model, base, examples[i], prompt[i], counts, scorer.envs)
                                  for i in todo))
    better: dict[int, tuple[Completion, np.ndarray]] = {}
    for i, ref in zip(todo, refs, strict=True):
        if ref is None:
            continue
        ref_scores = np.repeat(scorer.score(examples[i], [ref], step), n, axis=0)
        gain = combine_rewards(ref_scores, scorer.weights)[0][0] - combine_rewards(out_scores[i], scorer.weights)[0][0]
        if gain > 0:
            better[i] = (ref, ref_scores)
        elif gain < 0:
            _skip("not_better", examples[i], counts)
        else:
            _skip("no_gain", examples[i], counts)
    await asyncio.gather(*(with_logprobs(client, model, ref, prompt[i]) for i, (ref, _) in better.items()))
    for i, (ref, ref_scores) in better.items():
        g, flat = groups[i], combine_rewards(out_scores[i], scorer.weights)[0]
        k = len(g) - n
        out_groups[i] = [*g[:k], *[_copy(ref, g[0]) for _ in range(n)]]
        out_scores[i] = np.concatenate([out_scores[i][:k], ref_scores])
        trained = combine_rewards(out_scores[i], scorer.weights)[0]
        out_pools[i] = Pool(float(trained.mean()), float(trained.std(ddof=1)), len(trained), float(flat.mean()))
        counts["guide/groups"] = counts.get("guide/groups", 0.0) + 1
        counts["guide/completions"] = counts.get("guide/completions", 0.0) + n
    return out_groups, out_scores, out_pools


def _copy(ref: Completion, sampled: Completion) -> Completion:
    """A reference completion of its own (rows are never shared), continuing the prompt `sampled` continued."""
    return Completion(list(ref.token_ids), list(ref.logprobs), ref.text, ref.finish_reason,
                      prompt_ids=sampled.prompt_ids)
