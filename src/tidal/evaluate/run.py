"""`tidal eval` / `tidal.evaluate(...)`: score a model and its adapters on one environment's examples with vLLM.

Order: every check first (the model resolves, each adapter fits it, the environment builds and has examples: exit 2
naming what is wrong), then one vLLM server (`tidal.evaluate.serve`), then per row (base model, adapters) the greedy
and/or sampled completions of every example, scored by the environment as training scores them
(`tidal.orchestrator.evaluation.sample_group`, the online `eval`'s own sampler), summarized by
`tidal.monitor.eval_metrics.summarize` (the online `eval`'s metrics too). Each finished row goes to the partial
report beside the JSON at once, and `resume` keeps the rows an unfinished invocation scored
(`tidal.evaluate.partial`). The examples are the environment's fixed eval set, or `num_examples` drawn from it (or
generated) with `seed`; the sampled completions of example i use seed `seed + i` in every row, so two rows see the
same random numbers where their policies agree.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tidal.config.environments import EnvSection
from tidal.config.evaluate import EvalConfig
from tidal.config.load import ConfigError
from tidal.config.orch import ClientSection, SamplingSection
from tidal.envs import Environment, Example
from tidal.evaluate import partial
from tidal.evaluate.serve import Server, check_address
from tidal.evaluate.targets import Target, resolve_targets
from tidal.inference.protocol import Completion, InferenceClient
from tidal.monitor.eval_metrics import summarize


@dataclass
class Row:
    """One model's results: the metrics of its greedy and sampled completions, and a few completions."""

    label: str
    adapter: str | None
    greedy: dict[str, float] | None = None
    sampled: dict[str, float] | None = None
    rewards: dict[str, list[list[float]]] = field(default_factory=dict)
    """`greedy` / `sampled` -> per example, its completions' rewards (for paired comparisons between rows)."""
    samples: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    fingerprint: str = ""
    """What was scored: `base`, or the adapter's path and the sha256 of its files (`tidal.evaluate.partial`)."""


@dataclass
class EvalResult:
    """What `evaluate` returns (and `tidal eval` writes as JSON)."""

    rows: list[Row]
    examples: int
    env: str
    serve: str
    ready_s: float
    """Seconds until vLLM answered /health."""
    sample_s: float
    """Seconds from vLLM ready to the last row scored (adapter loads and merges included)."""
    config: dict[str, Any]


def pick_examples(env: Environment, name: str, num: int | None, seed: int) -> list[Example]:
    """The examples to score (`EvalConfig.num_examples`); ConfigError when the environment has no eval set and no
    number is given."""
    fixed = env.eval_examples()
    if fixed is not None:
        fixed = list(fixed)
        if num is None or num >= len(fixed):
            return fixed
        return random.Random(seed).sample(fixed, num)
    if num is None:
        raise ConfigError(f"env {name} has no fixed eval set: give num_examples (--num-examples N, drawn with --seed)")
    rng = random.Random(seed)
    return [env.sample(rng) for _ in range(num)]


def build_env(section: EnvSection) -> Environment:
    from tidal.orchestrator.evaluation import eval_env

    try:
        return eval_env(section, None)
    except (ValueError, ImportError, KeyError, TypeError) as exc:
        raise ConfigError(f"env {section.name or section.id}: {exc}") from None


@dataclass
class Plan:
    """Everything checked before vLLM starts."""

    model_dir: str
    targets: list[Target]
    env: Environment
    examples: list[Example]
    seq_len: int
    """Prompt + completion tokens at most (`max_model_len`, or the model's length capped at `DEFAULT_LEN`)."""
    out: Path
    """The JSON report's path (its partial report beside it: `tidal.evaluate.partial`)."""
    kept: dict[int, Row] = field(default_factory=dict)
    """Target index -> its row kept from the partial report (`resume`)."""
    kept_serve: str | None = None
    """How the kept rows were served (`lora` / `merged`); None without `resume`."""


DEFAULT_LEN = 4096


def model_length(model_dir: str, wanted: int | None) -> int:
    """`wanted`, or the positions the model holds (at most `DEFAULT_LEN`); ConfigError when `wanted` exceeds them."""
    from tidal.models.config import read_config
    from tidal.models.limits import max_positions

    found = max_positions(read_config(model_dir))
    if wanted is None:
        return min(found[0], DEFAULT_LEN) if found else DEFAULT_LEN
    if found is not None and wanted > found[0]:
        raise ConfigError(f"max_model_len {wanted} exceeds the model's {found[0]} positions ({found[1]})")
    return wanted


def prepare(cfg: EvalConfig) -> Plan:
    """The checks that run before anything starts (module docs); ConfigError names what is wrong."""
    from tidal.models.sources import resolve_model

    check_address(cfg)
    try:
        model_dir = resolve_model(cfg.model)
    except (OSError, ValueError, RuntimeError, ImportError, TimeoutError) as exc:
        raise ConfigError(f"model {cfg.model}: {exc}") from None
    targets = resolve_targets(model_dir, cfg.adapters, cfg.base)
    env = build_env(cfg.env)
    seq_len = model_length(model_dir, cfg.max_model_len)
    if cfg.max_tokens >= seq_len:
        raise ConfigError(f"max_tokens {cfg.max_tokens} leaves no room for a prompt under max_model_len {seq_len}")
    name = cfg.env.name or cfg.env.id
    examples = pick_examples(env, name, cfg.num_examples, cfg.seed)
    if cfg.address is None:  # the server tidal eval starts renders chat prompts with chat_template or the model's
        from tidal.models.chat_template import check_chat_prompts

        chat = env.tooling is not None or any(not isinstance(ex.prompt, str) for ex in examples)
        check_chat_prompts(cfg.model, model_dir, cfg.chat_template, [name] if chat else [],
                           "chat_template (tidal eval --chat-template)")
    out = Path(cfg.out or "eval.json")
    serve, kept = partial.kept_rows(cfg, targets, out)
    try:
        rows = {i: Row(**{**r, "label": targets[i].label}) for i, r in kept.items()}
    except TypeError as exc:
        raise ConfigError(f"resume: {partial.partial_path(out)} holds rows of another tidal version ({exc})") from None
    return Plan(model_dir, targets, env, examples, seq_len, out, rows, serve)


def evaluate(cfg: EvalConfig, progress: bool = True, log_path: Path | None = None) -> EvalResult:
    """Score `cfg`'s rows (module docs); vLLM's output goes to `log_path` (None: `eval-vllm.log` beside the JSON)."""
    from tidal.inference.backends.vllm.server import on_cpu
    from tidal.procs.reaper import start_reaper

    plan = prepare(cfg)
    out, name = plan.out, cfg.env.name or cfg.env.id
    if len(plan.kept) == len(plan.targets):  # resume: every row scored already, nothing to start
        rows = [plan.kept[i] for i in range(len(plan.targets))]
        return EvalResult(rows, len(plan.examples), name, plan.kept_serve or "", 0.0, 0.0, cfg.model_dump(mode="json"))
    server = Server(cfg, plan.targets, on_cpu(), plan.seq_len, log_path or out.with_name(f"{out.stem}-vllm.log"))
    if plan.kept and plan.kept_serve != server.mode:
        raise ConfigError(f"resume: {partial.partial_path(out)}'s rows were served {plan.kept_serve}, this "
                          f"invocation would serve {server.mode}: give serve: {plan.kept_serve}")
    start_reaper()
    try:
        ready = server.start(900.0 if cfg.address is None else 60.0)
        t1 = time.monotonic()
        rows = asyncio.run(score_rows(cfg, plan, server, progress))
        sample_s = time.monotonic() - t1
    finally:
        server.stop()
    return EvalResult(rows, len(plan.examples), name, server.mode, ready, sample_s, cfg.model_dump(mode="json"))


async def score_rows(cfg: EvalConfig, plan: Plan, server: Server, progress: bool) -> list[Row]:
    from tidal.inference.backends import make_client

    client = make_client(ClientSection(base_url=[f"{server.url}/v1"], chat_template_kwargs=cfg.chat_template_kwargs))
    todo = [i for i in range(len(plan.targets)) if i not in plan.kept]
    bar = Bar(len(todo) * len(plan.examples) * (int(cfg.greedy) + int(cfg.samples > 0)), progress)
    done = dict(plan.kept)

    def finished(i: int, row: Row) -> None:  # the partial report, after every row (tidal.evaluate.partial)
        done[i] = row
        partial.save(plan.out, cfg, server.mode, [asdict(done[j]) for j in sorted(done)])

    try:
        await client.wait_ready()
        tools = plan.env.tooling.schemas if plan.env.tooling is not None else None
        prompts = list(await asyncio.gather(*(client.tokenize_prompt(cfg.model, ex.prompt, tools)
                                              for ex in plan.examples)))
        if server.mode == "lora":
            await server.load_lora(client, plan.targets)
            for i in todo:
                await check_row(cfg, server, client, plan.targets[i], i)

            async def scored(i: int) -> None:
                finished(i, await score_row(cfg, plan, server, client, i, prompts, bar))

            await asyncio.gather(*(scored(i) for i in todo))
        else:
            for i in todo:  # merged: one row's weights at a time
                await server.load_merged(client, plan.targets[i])
                await check_row(cfg, server, client, plan.targets[i], i)
                finished(i, await score_row(cfg, plan, server, client, i, prompts, bar))
        return [done[i] for i in range(len(plan.targets))]
    finally:
        bar.close()
        await client.close()


async def check_row(cfg: EvalConfig, server: Server, client: InferenceClient, target: Target, index: int) -> None:
    """The policy identity check of an adapter row vLLM now serves (`tidal.orchestrator.identity`; EvalConfig
    `policy_check`): raises `PolicyMismatch` when vLLM serves another policy."""
    if not cfg.policy_check or target.adapter is None:
        return
    from tidal.orchestrator.identity import check_served

    record = server.probe(target)
    name = server.served_name(target, index)
    await check_served(lambda ids: client.prompt_logprobs(name, ids), record, what="tidal eval's vLLM",
                       path=str(target.adapter), off="tidal eval --no-policy-check", context=server.seq_len)


class Bar:
    """A progress bar over the groups sampled (rich; nothing when off)."""

    def __init__(self, total: int, on: bool) -> None:
        self.progress = None
        if on:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            self.progress = Progress("[tidal eval]", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                     transient=True)
            self.progress.start()
            self.task = self.progress.add_task("groups", total=total)

    def advance(self) -> None:
        if self.progress is not None:
            self.progress.advance(self.task)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


async def score_row(cfg: EvalConfig, plan: Plan, server: Server, client: InferenceClient, index: int,
                    prompts: list[list[int]], bar: Bar) -> Row:
    """One row: greedy and/or sampled completions of every example, scored and summarized."""
    from tidal.orchestrator.evaluation import sample_group

    target = plan.targets[index]
    name = server.served_name(target, index)
    row = Row(target.label, None if target.adapter is None else str(target.adapter),
              fingerprint=partial.fingerprint(target))
    sampling = SamplingSection(max_tokens=cfg.max_tokens)
    start = time.monotonic()

    async def one(i: int, k: int, temperature: float, seed: int | None) -> tuple[list[Completion], list[float]]:
        ex = plan.examples[i]
        group = await sample_group(client, name, plan.env, prompts[i], ex, k, sampling, plan.seq_len, seed,
                                   temperature, 0)
        bar.advance()
        return group, [float(x) for x in plan.env.score_rollouts(ex, group)]

    kinds = ([("greedy", 1, 0.0)] if cfg.greedy else []) + ([("sampled", cfg.samples, cfg.temperature)]
                                                            if cfg.samples else [])
    for kind, k, temperature in kinds:
        done = await asyncio.gather(*(one(i, k, temperature, None if kind == "greedy" else cfg.seed + i)
                                      for i in range(len(plan.examples))))
        rewards = [r for _, r in done]
        metrics = summarize(rewards, [[len(c.token_ids) for c in g] for g, _ in done],
                            [[c.finish_reason == "length" for c in g] for g, _ in done], seed=cfg.seed)
        if kind == "sampled":  # `accuracy` is the greedy completion's; a sampled row's first draw is pass@1's noise
            metrics = {k: v for k, v in metrics.items() if not k.startswith("accuracy")}
        setattr(row, kind, metrics)
        row.rewards[kind] = rewards
        if not row.samples:
            row.samples = [{"example": i, "prompt": prompt_text(plan.examples[i]), "completion": g[0].text,
                            "reward": r[0], "kind": kind, "prompt_ids": prompts[i], "token_ids": g[0].token_ids,
                            "finish_reason": g[0].finish_reason} for i, (g, r) in enumerate(done[:cfg.show_samples])]
    row.seconds = time.monotonic() - start
    return row


def prompt_text(example: Example) -> str:
    """The example's prompt as text: its last message's content (a chat prompt) or the prompt itself."""
    if isinstance(example.prompt, str):
        return example.prompt
    content = example.prompt[-1].get("content", "") if example.prompt else ""
    return content if isinstance(content, str) else str(content)
