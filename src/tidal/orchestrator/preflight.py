"""The orchestrator's config refusals, in one place: what scores a run is built by one function (`build_scoring`:
the environments, the reward functions, the filters, the custom advantage function), which `grpo-orch` builds its
loop from, and which `tidal grpo` / `GRPOTrainer(...)` run once on the derived orch config before anything starts
(`check_orch`, via `tidal.colocate.preflight`), so an unknown environment, a reward function that cannot be imported or
a run
with nothing to score exits 2 before vLLM starts instead of stopping the orchestrator once it is up.

Environments served elsewhere (`env[].address`, `env[].spawn`) are not built up front: that would start or reach
their servers; their checks stay with `grpo-orch`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tidal.config.load import ConfigError
from tidal.config.orch import OrchConfig
from tidal.envs.base import Environment, has_chat_prompts
from tidal.orchestrator.advantage import load_function
from tidal.orchestrator.envmix import EnvMix
from tidal.orchestrator.evaluation import eval_env
from tidal.orchestrator.filters import Filters
from tidal.orchestrator.guide import reference_eos, unfit
from tidal.orchestrator.partial import ROLLOUT_FUNC_WHY
from tidal.orchestrator.scoring import RewardFunc, Scorer

BUILD_ERRORS = (ValueError, FileNotFoundError)
"""What building an environment, a reward function or a filter raises for a bad config."""


@dataclass
class Scoring:
    """What turns a run's completions into a batch: examples, rewards, filters, advantages."""

    env: EnvMix
    scorer: Scorer
    filters: Filters
    custom: Any
    """The custom advantage function (orch `advantage.import_path`), or None."""


def give_tools(envs: Iterable[Any], tooling: Any, rollout_func: Any = None) -> None:
    """Give `tooling` (tools from the Python API) to the environments that have none of their own, and
    `rollout_func` (`tidal.orchestrator.rollout_func.RolloutFunc`, the Python API's) to every one."""
    for e in envs:
        if tooling is not None and e.tooling is None:
            e.tooling = tooling
        if rollout_func is not None:
            e.rollout_func = rollout_func


def build_scoring(cfg: OrchConfig, reward_funcs: list[RewardFunc] | None = None, tooling: Any = None,
                  rollout_func: Any = None) -> Scoring:
    """The run's `Scoring` from orch config `cfg`; `reward_funcs` / `tooling` / `rollout_func`: given in process
    (the Python API). Raises `ConfigError` naming what cannot be built."""
    try:
        env = EnvMix(cfg.env, cfg.buffer.env_ratios)
        give_tools(env.envs.values(), tooling, rollout_func)
        check_partial(cfg, env)
        check_guide(cfg, env)
        return Scoring(env, Scorer(env.envs, cfg, reward_funcs), Filters(cfg.filters, cfg.model.name),
                       load_function(cfg.advantage.import_path) if cfg.advantage.import_path else None)
    except BUILD_ERRORS as exc:
        raise ConfigError(f"orch: {exc}") from None


def check_partial(cfg: OrchConfig, env: EnvMix) -> None:
    """orch `partial_rollouts` continues the model turns tidal samples (`tidal.orchestrator.partial`: single-turn,
    multi-turn and tool rollouts alike); an environment sampled by a rollout function is refused (ValueError naming
    it and the keys)."""
    if cfg.partial_rollouts == "off":
        return
    for name, e in env.envs.items():
        if e.rollout_func is not None:
            raise ValueError(f"partial_rollouts: {cfg.partial_rollouts} does not combine with env '{name}': it is "
                             f"sampled by a rollout function (GRPOTrainer(rollout_func=...)): {ROLLOUT_FUNC_WHY}. "
                             f"Set partial_rollouts: off, or sample with tidal's own environments")


def check_guide(cfg: OrchConfig, env: EnvMix) -> None:
    """orch `guide_flat_groups` writes one reference turn (`tidal.orchestrator.guide`): every environment must be
    single-turn, without tools, an agent program or a rollout function, and the model must name its EOS token
    (ValueError naming the environment or the model and the key)."""
    if not cfg.guide_count():
        return
    for name, e in env.envs.items():
        if kind := unfit(e):
            raise ValueError(f"guide_flat_groups: {cfg.guide_flat_groups} does not combine with env '{name}': it "
                             f"has {kind}, and a reference answer is one completion of one turn. Set "
                             f"guide_flat_groups: 0 or train single-turn environments")
    if cfg.model.name is not None:  # else the served model's, when the orchestrator starts (`loop.run`)
        reference_eos(cfg.model.name)


def teacher_url(cfg: OrchConfig) -> str:
    """orch `teacher.base_url`; `ConfigError` when it is null outside `tidal grpo` (which starts the teacher)."""
    assert cfg.teacher is not None
    if cfg.teacher.base_url is None:
        raise ConfigError(f"orch teacher.base_url is null, which only `tidal grpo` serves (it starts a teacher "
                          f"server for teacher.model itself); grpo-orch needs the address of a running teacher "
                          f"server: start one with `tidal grpo-infer --model {cfg.teacher.model} --infer.port PORT` "
                          f"(docs/algorithms.md, on-policy distillation) and set teacher.base_url: "
                          f"http://HOST:PORT/v1")
    return cfg.teacher.base_url


def served_elsewhere(cfg: OrchConfig) -> bool:
    """Some environment of the run (training or eval) runs in a server of its own."""
    sections = [*cfg.env, *(cfg.eval.env if cfg.eval is not None else [])]
    return any(e.address is not None or e.spawn for e in sections)


def check_orch(cfg: OrchConfig, reward_funcs: list[RewardFunc] | None = None, tooling: Any = None
               ) -> dict[str, Environment]:
    """Every up-front refusal of an orch config: build its `Scoring` and its eval environments, and return them by
    name (for the checks that read their prompts, `chat_prompt_envs`; eval ones as `eval:NAME`). With environments
    served elsewhere only the filters and the custom advantage function are built (and none is returned). A
    teacher needs an address (`teacher_url`)."""
    if cfg.teacher is not None:
        teacher_url(cfg)
    if served_elsewhere(cfg):
        try:
            Filters(cfg.filters, cfg.model.name)
            if cfg.advantage.import_path:
                load_function(cfg.advantage.import_path)
        except BUILD_ERRORS as exc:
            raise ConfigError(f"orch: {exc}") from None
        return {}
    scoring = build_scoring(cfg, reward_funcs, tooling)
    envs: dict[str, Environment] = dict(scoring.env.envs)
    if cfg.eval is None:
        return envs
    try:
        for e in cfg.eval.env:
            envs[f"eval:{e.name or e.id}"] = eval_env(e, scoring.scorer)
    except BUILD_ERRORS as exc:
        raise ConfigError(f"orch: {exc}") from None
    return envs


def chat_prompt_envs(envs: dict[str, Environment]) -> list[str]:
    """Names of the environments in `envs` whose prompts need a chat template (`tidal.envs.base.has_chat_prompts`)."""
    return [name for name, env in envs.items() if has_chat_prompts(env)]
