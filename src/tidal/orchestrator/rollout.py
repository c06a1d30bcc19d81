"""Rollouts of one prompt: `n` single-turn completions, or `n` multi-turn rollouts with an environment.

Single-turn: one vLLM request for `n` completions within `sampling.max_tokens` and what `seq_len` leaves. Multi-
turn: each model turn ends at EOS or one of the environment's `stop` strings; the environment's reply is appended as
tokens with no loss (mask 0) and the model continues from the exact token ids, within `env.max_turns` turns and the
same token budget; a reply that raises `tidal.rewards.ServiceUnavailable` (a `tidal env-server` unreachable) ends
the rollout unjudged (`Completion.env_error`). Used for training batches and for evaluation. A prompt with images is
sampled through the chat API from its messages (`messages`: images as data URLs), the token ids checked against the
prompt's; multi-turn rollouts of prompts with images are refused (vLLM would have to take the images again with
every continuation's token prompt).

Each model turn is sampled through a `Turns` (plain: one request per turn on the group's model). With orch
`partial_rollouts` the in-flight stream hands in `tidal.orchestrator.partial.PartialTurns`, whose turns are stopped
at a policy switch and continued under the new policy: their tokens then carry `Completion.versions`, and an
environment's tokens get the version of the model token before them (`fill_versions`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tidal.config.orch import SamplingSection
from tidal.envs.base import Environment, Example
from tidal.envs.images import has_images
from tidal.inference.protocol import Completion, InferenceClient, InferenceError
from tidal.orchestrator.sampling import extra_sampling
from tidal.rewards import ServiceUnavailable


def full_group(comps: list[Completion], n: int, client: InferenceClient) -> list[Completion]:
    """`comps` when the sampler returned the `n` completions asked for, else InferenceError: a group shorter than
    `rollouts_per_example` would only fail later, where advantages split the rewards into groups of `n`. As an
    InferenceError, a training step is retried once the server answers (counted in `inference_retries`) and an
    evaluation skipped."""
    if len(comps) != n:
        raise InferenceError(f"the inference server ({', '.join(client.urls)}) returned {len(comps)} completions of "
                             f"one prompt, asked for {n} (rollouts_per_example)")
    return comps


class Turns:
    """How a rollout samples its model turns: here each turn is one request on `model` at `temperature`
    (`InferenceClient.sample`); `tidal.orchestrator.partial.PartialTurns` continues a turn across policy
    switches instead. `model` is also the name the rollout tokenizes with (partial rollouts: the base model, which
    outlives every adapter and shares their tokenizer)."""

    def __init__(self, client: InferenceClient, model: str, temperature: float) -> None:
        self.client, self.model, self.temperature = client, model, temperature

    async def first(self, prompt_ids: list[int], n: int, max_tokens: int, seed: int | None,
                    extra: dict[str, Any]) -> list[Completion]:
        """The first turn of `n` rollouts of one prompt (one request for `n` completions)."""
        return full_group(await self.client.sample(self.model, prompt_ids, n, max_tokens, self.temperature, seed,
                                                   extra), n, self.client)

    async def next(self, prompt_ids: list[int], max_tokens: int, seed: int | None,
                   extra: dict[str, Any]) -> Completion:
        """A later turn of one rollout, from the exact token ids so far (`prompt_ids`)."""
        return (await self.client.sample(self.model, prompt_ids, 1, max_tokens, self.temperature, seed, extra))[0]


TURN_SEED_STRIDE = 7919
"""Seeds of later turns: turn k of rollout i of a group seeded `seed` gets `seed + 7919 k + i` (`turn_seed`)."""


def turn_seed(seed: int | None, turn: int, index: int) -> int | None:
    """The sampling seed of model turn `turn` (0: the first) of rollout `index` of a group seeded `seed` (None:
    unseeded): `seed + 7919 turn + index`. Turn 0 is what vLLM gives child `index` of one request for `n`
    completions seeded `seed` (`seed + index`, vllm/v1/engine/parallel_sampling.py), so a rollout sampled turn by
    turn on its own (the agent endpoint, one request per call) draws the same tokens as the same rollout of the tool
    loop's group request. Every multi-turn path uses this one rule (`multi_turn_group`, `toolloop.tool_group`,
    `agentloop.ClientBackend`)."""
    return None if seed is None else seed + TURN_SEED_STRIDE * turn + index


def fill_versions(versions: list[int | None]) -> list[int] | None:
    """Per-token policy versions of a rollout whose environment tokens (None) sit between model turns: each
    environment token takes the version of the model token before it (the turn it answers; the first model token's
    when none precedes it), so the versions never decrease and span exactly those of the sampled tokens. None when
    no token has a version (no partial rollouts: the group's one policy)."""
    known = [v for v in versions if v is not None]
    if not known:
        return None
    out, last = [], known[0]
    for v in versions:
        last = last if v is None else v
        out.append(last)
    return out


async def rollout_group(client: InferenceClient, model: str, prompt_ids: list[int], n: int,
                        sampling: SamplingSection, seq_len: int, seed: int | None,
                        temperature: float | None = None,
                        messages: list[dict[str, Any]] | None = None) -> list[Completion]:
    """`n` completions of one prompt within `sampling.max_tokens` and what `seq_len` leaves; `messages`: the
    prompt's chat messages with images as data URLs (`tidal.envs.images.openai_messages`), sampled through the
    chat API (`prompt_ids` must be their tokens)."""
    room = seq_len - len(prompt_ids)
    if room < 1:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room under seq_len {seq_len}")
    max_tokens = min(sampling.max_tokens or room, room)
    extra = extra_sampling(sampling, max_tokens)
    temp = sampling.temperature if temperature is None else temperature
    if messages is not None:
        return full_group(await client.sample_chat(model, messages, prompt_ids, n, max_tokens, temp, seed, extra), n,
                          client)
    return full_group(await client.sample(model, prompt_ids, n, max_tokens, temp, seed, extra), n, client)


async def split_group(client: InferenceClient, model: str, prompt_ids: list[int], n: int, sampling: SamplingSection,
                      seq_len: int, seed: int | None, temperature: float,
                      on_done: Callable[[], None]) -> list[Completion]:
    """`rollout_group` as `n` requests of one completion each, so that the caller learns when each completion is
    done (`on_done`, called once per request however it ends): the in-flight stream counts the sequences still
    running, not whole groups (`tidal.orchestrator.stream`). vLLM fans a request for `n` completions out into `n`
    sequences anyway; the prompt is prefilled once per sequence either way (prefix caching shares it). A failed
    request cancels the others and raises. Request i is seeded `seed + i` (`seed` set)."""
    async def one(i: int) -> Completion:
        return (await rollout_group(client, model, prompt_ids, 1, sampling, seq_len,
                                    None if seed is None else seed + i, temperature))[0]

    return await all_or_cancel([one(i) for i in range(n)], on_done)


async def all_or_cancel(coros: list[Any], on_done: Callable[[], None] | None = None) -> list[Completion]:
    """Run `coros` at once; a failure cancels the others and raises. `on_done`: called once per coroutine however it
    ends (also when cancelled before it ran)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if on_done is not None:
        for t in tasks:
            t.add_done_callback(lambda _: on_done())
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def multi_turn_group(client: InferenceClient, model: str, prompt_ids: list[int], n: int,
                           sampling: SamplingSection, seq_len: int, seed: int | None, temperature: float,
                           env: Environment, example: Example, turns: Turns | None = None) -> list[Completion]:
    """`n` multi-turn rollouts: each model turn ends at EOS or one of `env.stop`; the environment's reply
    (`env.respond`) is appended as tokens with no loss (mask 0) and the model continues, within `env.max_turns`
    turns and the completion budget (`sampling.max_tokens`, `seq_len`). `turns`: how each model turn is sampled
    (module doc; default: one request per turn on `model`)."""
    if has_images(example.prompt):
        raise ValueError(f"environment '{env.id}' is multi-turn (max_turns {env.max_turns}) and its prompt holds "
                         "images; tidal samples prompts with images single-turn only (max_turns: 1)")
    budget = min(sampling.max_tokens or seq_len, seq_len - len(prompt_ids))
    extra = {**extra_sampling(sampling, budget), "stop": list(env.stop), "include_stop_str_in_output": True}
    how = turns or Turns(client, model, temperature)
    first = await how.first(prompt_ids, n, budget, seed, extra)

    async def continue_one(i: int, c: Completion) -> Completion:
        ids, lps, mask, text = list(c.token_ids), list(c.logprobs), [1] * len(c.token_ids), c.text
        vers: list[int | None] = [None] * len(c.token_ids) if c.versions is None else list(c.versions)
        finish, env_error = c.finish_reason, None
        for turn in range(1, env.max_turns):
            try:
                reply = env.respond(example, text) if finish != "length" else None
            except ServiceUnavailable as exc:  # the environment's side failed: the rollout is not judged
                env_error = str(exc)
                break
            if reply is None:
                break
            reply_ids = await client.tokenize_text(how.model, reply)
            room = budget - len(ids) - len(reply_ids)
            if room < 1:
                finish = "length"
                break
            ids, lps, text = ids + reply_ids, lps + [0.0] * len(reply_ids), text + reply
            mask += [0] * len(reply_ids)
            vers += [None] * len(reply_ids)
            nxt = await how.next(prompt_ids + ids, room, turn_seed(seed, turn, i), {**extra, "min_tokens": 0})
            ids, lps, text = ids + nxt.token_ids, lps + nxt.logprobs, text + nxt.text
            mask += [1] * len(nxt.token_ids)
            vers += [None] * len(nxt.token_ids) if nxt.versions is None else nxt.versions
            finish = nxt.finish_reason
        return Completion(ids, lps, text, finish, None, mask, env_error=env_error, versions=fill_versions(vers))

    return list(await asyncio.gather(*(continue_one(i, c) for i, c in enumerate(first))))
