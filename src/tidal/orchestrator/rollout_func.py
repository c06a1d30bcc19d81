"""TRL's custom-rollout hook, `GRPOTrainer(rollout_func=...)`: a user function samples each group instead of tidal.

TRL 1.16 calls `rollout_func(prompts, trainer)` and trains on what it returns: a dict with `prompt_ids`,
`completion_ids` and `logprobs` (one row per prompt given), optionally `logprob_token_ids` (the same shape as
`logprobs`) and `env_mask` (per completion token: 1 sampled by the model, 0 inserted by an environment: no loss);
every other key is forwarded to the reward functions as a keyword argument (a list: one value per completion; any
other value: the same for every completion).

In tidal the orchestrator calls the function once per group, in a worker thread, with the example's prompt
repeated `rollouts_per_example` times (TRL's repeat sampler hands it each prompt `num_generations` times in a row,
and it returns one completion per entry) and a `RolloutTrainer` as `trainer`. tidal has no in-process generator:
the function samples through tidal's vLLM server, from the policy the orchestrator serves now, with
- `trainer.vllm_generation.generate(prompts=token_id_lists, images=None, num_generations=k)`: TRL 1.16's
  `VLLMGeneration.generate` (prompts already repeated `k` times in a row; returns `(prompt_ids, completion_ids,
  logprobs, logprob_token_ids)`, the logprobs as `[[lp], ...]` per completion, TRL's top-1 shape);
- `generate_rollout_completions(trainer, prompts)`: the helper of TRL's rollout_func examples (OpenEnv docs): one
  completion per prompt (a string: as is; chat messages: the model's chat template), a dict per completion with
  `prompt_ids`, `completion_ids`, `logprobs` and `text`;
- `trainer.processing_class` (the tokenizer: the one given to GRPOTrainer, else the model's), `trainer.args`
  (the GRPOConfig), `trainer.num_generations`, `trainer.state.global_step`.
Sampling uses the run's orch `sampling` keys (temperature at the step, `max_tokens`, top_p/top_k/min_p/...), within
`seq_len`; with `sampling.seed` each request of a group is seeded from the group's seed. Whatever else TRL's trainer
has (`model`, `accelerator`, `optimizer`, ...) lives in tidal's trainer process: reading it raises AttributeError
saying so.

The tokens are trained on as returned (tokens, not text): the group's prompt is the returned `prompt_ids` (the same
for every completion of the group: tidal trains a group against one prompt), the completion tokens and their
logprobs go into the TrainingBatch as sampled. Malformed output raises ValueError / TypeError naming the key.
Simplifications: a completion's `finish_reason` is "stop" when it ends at the tokenizer's EOS or is shorter than the
budget, else "length"; the text reward functions get is the tokens decoded without special tokens (as TRL does).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from tidal.config.orch import SamplingSection
from tidal.envs.base import Example
from tidal.inference.protocol import Completion, InferenceClient
from tidal.orchestrator.rollout import full_group
from tidal.orchestrator.sampling import extra_sampling

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")
"""Keys every rollout_func output holds (TRL's contract)."""
RESERVED = frozenset({"prompts", "completions", "completion_ids", "trainer_state", "log_metric", "environments"})
"""Reward-function keywords tidal sets itself: an extra field of one of these names would be ambiguous."""
SEED_STRIDE = 1009
"""Seed offset between the generate calls of one group (each request within a call adds its index)."""


@dataclass
class RolloutState:
    """TRL's `trainer.state`, as far as a rollout can know it."""

    global_step: int
    """Optimizer steps done by the policy that samples (tidal's batch n is sampled by policy >= n - 1 - async)."""
    max_steps: int
    """The run's steps (0: unbounded)."""


class RolloutFunc:
    """The user's rollout function with what it needs beside the server: the model's tokenizer and the config."""

    def __init__(self, fn: Callable[..., Any], model: str, tokenizer: Any, args: Any = None) -> None:
        """`tokenizer`: the model's (a transformers tokenizer; the caller loads it: the orchestrator imports no
        transformers), handed to the function as `trainer.processing_class` and used to decode completions."""
        if not callable(fn):
            raise TypeError(f"GRPOTrainer(rollout_func=...) must be a function (prompts, trainer) -> dict, got a "
                            f"{type(fn).__name__}")
        self.fn, self.model, self.args = fn, model, args
        self.tokenizer = getattr(tokenizer, "tokenizer", None) or tokenizer  # a processor's tokenizer

    async def group(self, client: InferenceClient, model: str, prompt_ids: list[int], n: int,
                    sampling: SamplingSection, seq_len: int, seed: int | None, temperature: float, example: Example,
                    step: int = 1, max_steps: int | None = None) -> list[Completion]:
        """`n` completions of `example` from the user's function (see the module docs); `model`: the policy served
        now, `prompt_ids`: the example's prompt tokens (only a default: the function returns its own)."""
        tokenizer = self.tokenizer
        trainer = RolloutTrainer(self, client, model, asyncio.get_running_loop(), sampling, seq_len, seed,
                                 temperature, n, RolloutState(max(step - 1, 0), max_steps or 0))
        out = await asyncio.to_thread(self.fn, [example.prompt] * n, trainer)
        budget = min(sampling.max_tokens or seq_len, seq_len)
        return completions_of(out, n, seq_len, budget, tokenizer)


class VLLMGeneration:
    """TRL 1.16's `trainer.vllm_generation`, backed by tidal's inference server."""

    def __init__(self, trainer: RolloutTrainer) -> None:
        self.trainer = trainer

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"trainer.vllm_generation.{name} is not available in tidal: tidal's vLLM server is "
                             f"another process, which the orchestrator keeps serving the current policy (no "
                             f"sync_weights, no in-process LLM); a rollout_func samples with "
                             f"trainer.vllm_generation.generate")

    def generate(self, prompts: list[list[int]], images: Any = None, num_generations: int = 1,
                 profiler: Any = None) -> tuple[list[list[int]], list[list[int]], list[list[list[float]]],
                                                list[list[list[int]]]]:
        """TRL's `VLLMGeneration.generate`: `prompts` are token id lists, each repeated `num_generations` times in a
        row; one request of `num_generations` completions per distinct prompt. Returns (prompt_ids, completion_ids,
        logprobs, logprob_token_ids), one row per prompt given, logprobs in TRL's `[[lp], ...]` shape. `profiler`: a
        context manager held around the requests, as TRL holds it."""
        if images is not None and any(i is not None for i in images):
            raise NotImplementedError("trainer.vllm_generation.generate(images=...): tidal samples a rollout_func's "
                                      "requests from token ids only; images are not supported here")
        k = int(num_generations)
        if k < 1 or len(prompts) % k:
            raise ValueError(f"trainer.vllm_generation.generate: {len(prompts)} prompts are not a multiple of "
                             f"num_generations={k} (TRL passes each prompt num_generations times in a row)")
        firsts = [list(p) for p in prompts[::k]]
        for j, first in enumerate(firsts):
            if any(list(p) != first for p in prompts[j * k:(j + 1) * k]):
                raise ValueError(f"trainer.vllm_generation.generate: prompts[{j * k}:{(j + 1) * k}] are not one prompt "
                                 f"repeated num_generations={k} times (TRL samples the first of each run of {k})")
        with profiler if profiler is not None else contextlib.nullcontext():
            groups = self.trainer.run(self.trainer.sample_many(firsts, k))
        comps = [c for g in groups for c in g]
        return ([p for p in firsts for _ in range(k)], [c.token_ids for c in comps],
                [[[lp] for lp in c.logprobs] for c in comps], [[[t] for t in c.token_ids] for c in comps])


class RolloutTrainer:
    """What a rollout function gets as `trainer` (see the module docs); other attributes raise AttributeError with
    the reason."""

    def __init__(self, owner: RolloutFunc, client: InferenceClient, model: str, loop: asyncio.AbstractEventLoop,
                 sampling: SamplingSection, seq_len: int, seed: int | None, temperature: float, n: int,
                 state: RolloutState) -> None:
        self.args = owner.args
        self.processing_class = owner.tokenizer
        self.num_generations = self.num_generations_eval = n
        self.state = state
        self.model_name = owner.model
        self.vllm_generation = VLLMGeneration(self)
        self._client, self._model, self._loop = client, model, loop
        self._sampling, self._seq_len, self._seed, self._temperature = sampling, seq_len, seed, temperature
        self._calls = 0

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"trainer.{name} is not available to a rollout_func in tidal: the model, optimizer and "
                             f"accelerator live in tidal's trainer process; a rollout_func gets args, "
                             f"processing_class, num_generations, state and vllm_generation.generate (or "
                             f"tidal.generate_rollout_completions(trainer, prompts)) to sample from the policy served "
                             f"now")

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run `coro` on the orchestrator's loop from the rollout function's thread, and wait for it."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: the rollout function's worker thread
            running = None
        if running is self._loop:
            coro.close()
            raise RuntimeError("a rollout_func's generate helpers are called from its own thread, not the "
                               "orchestrator's event loop")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def sample_many(self, prompts: list[list[int]], k: int, overrides: dict[str, Any] | None = None
                          ) -> list[list[Completion]]:
        """`k` completions of each prompt (token ids), one request per prompt, at once."""
        call, self._calls = self._calls, self._calls + 1
        temp = float((overrides or {}).get("temperature", self._temperature))

        async def one(j: int, ids: list[int]) -> list[Completion]:
            room = self._seq_len - len(ids)
            if room < 1:
                raise ValueError(f"rollout_func prompt {j} of {len(ids)} tokens leaves no room under seq_len "
                                 f"{self._seq_len}")
            max_tokens = min(int((overrides or {}).get("max_tokens") or self._sampling.max_tokens or room), room)
            seed = None if self._seed is None else self._seed + SEED_STRIDE * call + j
            extra = extra_sampling(self._sampling, max_tokens)
            return full_group(await self._client.sample(self._model, ids, k, max_tokens, temp, seed, extra), k,
                              self._client)

        return list(await asyncio.gather(*(one(j, p) for j, p in enumerate(prompts))))


OVERRIDES = ("temperature", "max_tokens")
"""`generation_overrides` keys `generate_rollout_completions` takes."""


def generate_rollout_completions(trainer: RolloutTrainer, prompts: list[Any],
                                 generation_overrides: dict[str, Any] | None = None,
                                 as_chat: bool | None = None) -> list[dict[str, Any]]:
    """One completion per prompt from the policy served now (TRL's OpenEnv helper for rollout functions): a string
    prompt is sent as is, chat messages with the model's chat template (`as_chat` forces one or the other). Returns a
    dict per prompt with `prompt_ids`, `completion_ids`, `logprobs` (floats) and `text`. `generation_overrides`:
    `temperature` and/or `max_tokens` for these requests."""
    if not isinstance(trainer, RolloutTrainer):
        raise TypeError(f"generate_rollout_completions(trainer, ...) takes the trainer tidal hands a rollout_func, "
                        f"got a {type(trainer).__name__}")
    bad = sorted(set(generation_overrides or {}) - set(OVERRIDES))
    if bad:
        raise ValueError(f"generate_rollout_completions(generation_overrides=...): {bad} not supported by tidal "
                         f"(supported: {list(OVERRIDES)}; the other sampling keys are the run's orch sampling)")
    for i, p in enumerate(prompts):
        chat = not isinstance(p, str) if as_chat is None else as_chat
        if chat == isinstance(p, str):
            raise ValueError(f"generate_rollout_completions: prompts[{i}] is a {type(p).__name__}, but as_chat="
                             f"{as_chat} needs {'chat messages' if chat else 'a string'}")
    client, model = trainer._client, trainer._model

    async def go() -> tuple[list[list[int]], list[list[Completion]]]:
        ids = list(await asyncio.gather(*(client.tokenize_prompt(model, p) for p in prompts)))
        return ids, await trainer.sample_many(ids, 1, generation_overrides)

    ids_of, groups = trainer.run(go())
    return [{"prompt_ids": list(p), "completion_ids": g[0].token_ids, "logprobs": g[0].logprobs, "text": g[0].text}
            for p, g in zip(ids_of, groups, strict=True)]


def rows(out: dict[str, Any], key: str, n: int) -> list[Any]:
    """`out[key]` as `n` rows; ValueError naming the key otherwise."""
    value = out[key]
    if hasattr(value, "tolist"):  # a tensor or an array
        value = value.tolist()
    if not isinstance(value, list | tuple) or len(value) != n:
        got = f"{len(value)} rows" if isinstance(value, list | tuple) else f"a {type(value).__name__}"
        raise ValueError(f"rollout_func output {key!r} has {got}, expected a list of {n} (one per prompt given: "
                         f"rollouts_per_example)")
    return [v.tolist() if hasattr(v, "tolist") else v for v in value]


def token_row(value: Any, key: str, i: int) -> list[int]:
    if not isinstance(value, list | tuple) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"rollout_func output {key!r}[{i}] must be a list of token ids (ints), got "
                         f"{type(value).__name__}{'' if not isinstance(value, list | tuple) else ' with non-ints'}")
    return list(value)


def logprob_row(value: Any, i: int, length: int) -> list[float]:
    """A completion's logprobs: floats, or TRL's top-k shape `[[lp, ...], ...]` (the first is the sampled token's)."""
    if not isinstance(value, list | tuple) or len(value) != length:
        got = f"{len(value)} values" if isinstance(value, list | tuple) else f"a {type(value).__name__}"
        raise ValueError(f"rollout_func output 'logprobs'[{i}] has {got} for {length} completion tokens")
    out = []
    for lp in value:
        lp = lp[0] if isinstance(lp, list | tuple) and lp else lp
        if not isinstance(lp, int | float) or isinstance(lp, bool) or not math.isfinite(lp) or lp > 1e-6:
            raise ValueError(f"rollout_func output 'logprobs'[{i}] holds {lp!r}: each must be a finite log "
                             f"probability (<= 0) of the sampled token")
        out.append(min(float(lp), 0.0))
    return out


def completions_of(out: Any, n: int, seq_len: int, budget: int, tokenizer: Any) -> list[Completion]:
    """The `n` Completions a rollout function's output means (see the module docs); raises naming the bad key."""
    if not isinstance(out, dict):
        raise TypeError(f"rollout_func must return a dict with {list(REQUIRED)}, got a {type(out).__name__}")
    missing = [k for k in REQUIRED if k not in out]
    if missing:
        raise ValueError(f"rollout_func must return keys {missing} in its output dict (TRL's contract: "
                         f"{list(REQUIRED)}, optionally logprob_token_ids and env_mask, other keys go to the reward "
                         f"functions)")
    prompts = [token_row(p, "prompt_ids", i) for i, p in enumerate(rows(out, "prompt_ids", n))]
    if any(p != prompts[0] for p in prompts):
        raise ValueError("rollout_func output 'prompt_ids' differ within one group: tidal trains a group of "
                         "rollouts_per_example completions against one prompt; return the same prompt_ids for each")
    ids = [token_row(c, "completion_ids", i) for i, c in enumerate(rows(out, "completion_ids", n))]
    lps = [logprob_row(v, i, len(c)) for i, (v, c) in enumerate(zip(rows(out, "logprobs", n), ids, strict=True))]
    if "logprob_token_ids" in out:
        for i, (v, c) in enumerate(zip(rows(out, "logprob_token_ids", n), ids, strict=True)):
            firsts = [t[0] if isinstance(t, list | tuple) and t else t for t in (v or [])]
            if firsts != c:
                raise ValueError(f"rollout_func output 'logprob_token_ids'[{i}] does not start each position with "
                                 f"the sampled token of completion_ids[{i}]: the logprobs must be the sampled "
                                 f"tokens'")
    masks: list[list[int] | None] = [None] * n
    if "env_mask" in out:
        masks = []
        for i, (m, c) in enumerate(zip(rows(out, "env_mask", n), ids, strict=True)):
            if not isinstance(m, list | tuple) or len(m) != len(c) or any(x not in (0, 1) for x in m):
                raise ValueError(f"rollout_func output 'env_mask'[{i}] must be {len(c)} values of 0 or 1 (one per "
                                 f"completion token: 1 sampled by the model, 0 inserted by the environment)")
            masks.append([int(x) for x in m])
    fields = extra_fields(out, n)
    eos = getattr(tokenizer, "eos_token_id", None)
    comps = []
    for i, c in enumerate(ids):
        if len(prompts[0]) + len(c) > seq_len:
            raise ValueError(f"rollout_func output: prompt_ids[{i}] + completion_ids[{i}] are {len(prompts[0])} + "
                             f"{len(c)} tokens, over seq_len {seq_len}")
        finish = "stop" if (c and c[-1] == eos) or len(c) < budget else "length"
        comps.append(Completion(c, lps[i], tokenizer.decode(c, skip_special_tokens=True), finish, None, masks[i],
                                prompt_ids=prompts[0], fields={k: v[i] for k, v in fields.items()}))
    return comps


def extra_fields(out: dict[str, Any], n: int) -> dict[str, list[Any]]:
    """The output's other keys as `n` values each (a list of `n`: one per completion; anything else: repeated)."""
    fields: dict[str, list[Any]] = {}
    for key, value in out.items():
        if key in (*REQUIRED, "logprob_token_ids", "env_mask"):
            continue
        if key in RESERVED:
            raise ValueError(f"rollout_func output key {key!r} is a keyword tidal passes the reward functions "
                             f"itself ({sorted(RESERVED)}); rename it")
        fields[key] = rows(out, key, n) if isinstance(value, list | tuple) else [value] * n
    return fields
