"""Partial rollouts (orch `partial_rollouts: abort_resume`): a policy change reaches completions already running.

Without it (`off`) an in-flight completion keeps the policy it started with until it ends, so under long-tailed
lengths the longest completions are sampled throughout by the stalest policies of a batch. With it, every model turn
(each completion of a single-turn text group, `partial_group`; each turn of a multi-turn or tool rollout,
`PartialTurns`) is sampled as a streamed request (`VllmClient.sample_stream`) registered with the stream's `Switch`;
when the policy follower serves a newer policy the switch stops the running requests (vLLM aborts them as their
connections close), keeps every token received, and each turn continues under the new policy from prompt + its
tokens so far as a token prompt, within what is left of its token budget (`partial_turn`):
- LoRA adapters (`reload: lora`): the new adapter is loaded first (running requests keep sampling meanwhile), then
  every request on an older policy is stopped and continues on the new adapter;
- merged reloads (`reload: merged`): every running request is stopped and new ones are held *before* the weights
  change (`before_load`), and released once the new weights serve (`after_load`), so no token is sampled while
  the weights change.
Either way every token keeps the logprob vLLM reported when it sampled it (the true behaviour logprob) and the
version of the policy that sampled it (`Completion.versions`); a token is never attributed to a policy it was not
sampled under, because the tokens kept are those received before the switch asked vLLM to stop (a merged reload
starts only after that).

Multi-turn and tool rollouts: within a turn the environment takes no part (the model samples from the conversation
so far, as token ids), so a turn is stopped and continued like a single-turn completion; the loops
(`rollout.multi_turn_group`, `toolloop.tool_group`) take their turns from `PartialTurns` instead of plain requests
and append the environment's / tools' tokens between turns as before. Those tokens (loss mask 0) get the version of
the model token before them (`rollout.fill_versions`). A stop string split by a switch (begun before it, ended
after) would not be seen by vLLM, which matches stop strings in a request's own output only: the continuation's
streamed text is checked against the turn's text so far (`stop_across`, past `min_tokens` as vLLM does) and ends
the turn there; a continued turn's text is the server's detokenization of all its tokens, cut as vLLM cuts a
completion's (`continued_text`).

Staleness is orchestrator-side and per group, "a sample is as stale as its oldest token": the group keeps the
version its requests started under (`Group.version[0]`, which no token predates) for `max_off_policy_steps` and
the staleness metrics, and its newest token's version as `version[1]`. Chosen over per-token masking because it
needs no change in the trainer's loss (the per-token behaviour logprobs already make the importance ratio exact
per token), keeps a group's advantages computed over complete samples, and with partial rollouts a long
completion's oldest tokens are its first few, sampled when it started: the bound the user sets on the policy lag
still holds for every token trained on. So a group's staleness and the groups dropped as stale do not change with
partial rollouts; the staleness of the tokens does (`token_staleness`, per batch).

What a continuation changes, and why it is sound: vLLM's sampling state of a request is its token history (the
repetition penalty reads prompt + output, both carried over), its seed (a continuation is seeded `seed + 7919 x
segment`, so each segment is seeded, but draws other random numbers than the uninterrupted request would have: the
tokens are equally likely, not the same; a greedy continuation is the same), `min_tokens` (what is left of it) and
its stop strings (above). A seeded run with partial rollouts is not reproducible: where a request is stopped (the
token a segment starts at) follows the wall clock of the policy switch, so two runs split their requests at other
tokens and sample other continuations. The prompt's KV cache is prefilled again (prefix caching shares what it can). A
teacher scores the finished completion, every segment (`fill.with_teacher`). Refused: prompts with images (a
continuation is a token prompt; vLLM takes images with chat prompts only), rollout-function environments (the
function returns its own token rows, which tidal cannot map back to the requests and versions that sampled them),
router replay (a request stopped by closing its stream returns no routes; `OrchConfig._check_partial` says what
vLLM 0.32 would allow), nccl pushes and SGLang (`OrchConfig._check_partial`, `tidal.orchestrator.preflight.
check_partial`, `refuse_whole_group`); a single-turn group's requests are always split, one per completion.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from tidal.config.orch import SamplingSection
from tidal.inference.protocol import Completion, InferenceClient
from tidal.orchestrator.policy import PolicyTracker
from tidal.orchestrator.rollout import Turns, all_or_cancel
from tidal.orchestrator.sampling import extra_sampling

log = logging.getLogger("tidal.orch")

SEGMENT_SEED_STRIDE = 7919
"""A continued request's seed: `seed + SEGMENT_SEED_STRIDE x segment` (segment 0: the request's own seed)."""


class Switch:
    """The running partial requests of one in-flight stream, and what a policy switch does to them (module doc).
    `off` (orch `partial_rollouts: off`): every hook is a no-op and the stream samples as without it."""

    def __init__(self, mode: str, policy: PolicyTracker, merged: bool) -> None:
        self.on, self.policy, self.merged = mode != "off", policy, merged
        self.open = asyncio.Event()  # cleared while merged weights change: no request may run
        self.open.set()
        self.running: dict[asyncio.Event, int] = {}  # stop event -> the policy version its request runs on
        self.idle = asyncio.Event()  # no request running
        self.idle.set()
        self.counts: dict[str, float] = {}

    def _count(self, key: str, v: float = 1.0) -> None:
        self.counts[key] = self.counts.get(key, 0.0) + v

    def _stop(self, older_than: int | None) -> None:
        """Stop the running requests on a policy older than `older_than` (None: all)."""
        for ev, version in self.running.items():
            if not ev.is_set() and (older_than is None or version < older_than):
                ev.set()
                self._count("partial/stopped_requests")

    async def before_load(self) -> None:
        """The follower is about to load a newer policy: with merged reloads, hold new requests and stop the
        running ones, and wait until they have stopped (the weights must not change under a request)."""
        if not (self.on and self.merged):
            return
        self.open.clear()
        self._stop(None)
        await self.idle.wait()

    def after_load(self) -> None:
        """The follower loaded a policy (or failed to): release held requests; with LoRA, stop the requests
        still on an older adapter so that they continue on the new one."""
        if not self.on:
            return
        self._count("partial/switches")
        self.open.set()
        if not self.merged:
            self._stop(self.policy.step)

    def take_counts(self, counts: dict[str, float], step: int, groups: list[list[Completion]],
                    versions: list[tuple[int, int]]) -> None:
        """Add the counts since the previous batch and batch `step`'s token staleness (`token_staleness`, in
        either mode) to `counts`, and start counting again."""
        for k, v in self.counts.items():
            counts[k] = counts.get(k, 0.0) + v
        self.counts = {}
        counts.update(token_staleness(step, groups, [v[0] for v in versions]))

    async def segment(self, client: Any, prompt_ids: list[int], max_tokens: int, temperature: float,
                      seed: int | None, extra: dict[str, Any],
                      until: Callable[[str, int], bool] | None = None) -> tuple[Completion, int]:
        """One request of a partial completion on the policy served now, until it ends, a switch stops it or
        `until` says its text ends the turn (`VllmClient.sample_stream`); with the version that sampled its
        tokens."""
        while not self.open.is_set():
            await self.open.wait()
        model, version = self.policy.lease()
        stop = asyncio.Event()
        self.running[stop] = version
        self.idle.clear()
        try:
            if version < self.policy.step:  # a switch between the lease and here: continue on the new policy
                stop.set()
            part = await client.sample_stream(model, prompt_ids, max_tokens, temperature, stop, seed, extra,
                                              until=until)
        finally:
            del self.running[stop]
            if not self.running:
                self.idle.set()
            self.policy.release(model)
        return part, version


async def partial_turn(switch: Switch, client: Any, prompt_ids: list[int], max_tokens: int, temperature: float,
                       seed: int | None, extra: dict[str, Any]) -> Completion:
    """One model turn of `prompt_ids` (a single-turn completion, or one turn of a multi-turn / tool rollout)
    within `max_tokens`, sampled with the request keys `extra` and continued across policy switches (module doc):
    its tokens, their behaviour logprobs and (`versions`) the policy version of each. A continuation asks for what
    is left of `min_tokens`, and ends where a stop string of `extra["stop"]` that began before the switch ends
    (`stop_across`: vLLM matches stop strings in a request's own output only)."""
    ids: list[int] = []
    lps: list[float] = []
    versions: list[int] = []
    texts: list[str] | None = []
    text, segment, reason = "", 0, ""
    stops = [s for s in extra.get("stop") or [] if s]
    while True:
        left = max_tokens - len(ids)
        seg_extra = dict(extra)
        if "min_tokens" in extra:
            seg_extra["min_tokens"] = max(0, min(left, int(extra["min_tokens"]) - len(ids)))
        seg_seed = None if seed is None else seed + SEGMENT_SEED_STRIDE * segment
        until = stop_across(text, stops, int(seg_extra.get("min_tokens", 0))) if segment else None
        part, version = await switch.segment(client, prompt_ids + ids, left, temperature, seg_seed, seg_extra, until)
        ids, lps, text = ids + part.token_ids, lps + part.logprobs, text + part.text
        versions += [version] * len(part.token_ids)
        texts = texts + part.token_texts if texts is not None and part.token_texts is not None else None
        reason = part.finish_reason
        if reason != "interrupted":
            break
        if len(ids) >= max_tokens:
            reason = "length"
            break
        segment += 1
        switch._count("partial/resumed_requests")
    if segment:  # the text of a continued turn as one piece (a character may span two requests)
        text = await continued_text(client, prompt_model(switch), ids, reason, extra)
    return Completion(ids, lps, text, reason, texts, versions=versions)


def stop_across(text: str, stops: list[str], min_tokens: int) -> Callable[[str, int], bool] | None:
    """For a continued request of a turn whose text so far is `text`: a test of the new request's text and token
    count that is True once a stop string begun in `text` ends in it (vLLM matches stop strings in a request's own
    output only, so it would sample on past it); as vLLM does, a stop string counts only when it ends after the text
    of the request's first `min_tokens` tokens. None when no stop string could span the two requests."""
    # the longest end of `text` that begins some stop string (and is not all of it)
    tail = max((text[len(text) - k:] for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), key=len,
               default="")
    if not tail:
        return None
    after = [0]  # characters of the new text within its first min_tokens tokens (one token per streamed chunk)

    def until(new: str, tokens: int) -> bool:
        if tokens <= min_tokens:
            after[0] = len(new)
            return False
        both, edge = tail + new, len(tail) + after[0]  # a stop string must end past `edge`
        return any(both.find(s, max(0, edge - len(s) + 1)) >= 0 for s in stops)
    return until


async def continued_text(client: Any, model: str, ids: list[int], reason: str, extra: dict[str, Any]) -> str:
    """The text of a continued turn's tokens `ids` as the server detokenizes it, shown as vLLM shows a
    completion's text: cut at the stop string of `extra["stop"]` that its final token completed (the string kept with
    `include_stop_str_in_output`), else without the final token when it stopped the turn (EOS: vLLM leaves its text
    out, unless both `include_stop_str_in_output` and `skip_special_tokens: false`). Simplification: the server's
    `/detokenize` keeps special tokens, so one sampled mid-turn (not the final EOS) shows in the text even where the
    request skipped special tokens."""
    if reason != "stop" or not ids:
        return str(await client.detokenize(model, ids))
    full, before = await asyncio.gather(client.detokenize(model, ids), client.detokenize(model, ids[:-1]))
    # the stop string ends in the final token's text (vLLM stops at the first one it matches past min_tokens)
    hits = [(at + len(s), s) for s in extra.get("stop") or [] if s
            for at in [full.find(s, max(0, len(before) - len(s) + 1))] if at >= 0]
    if hits:
        end, s = min(hits)
        return str(full[:end] if extra.get("include_stop_str_in_output") else full[:end - len(s)])
    keep_eos = extra.get("include_stop_str_in_output") and extra.get("skip_special_tokens") is False
    return str(full if keep_eos else before)


async def partial_completion(switch: Switch, client: Any, prompt_ids: list[int], max_tokens: int,
                             sampling: SamplingSection, temperature: float, seed: int | None) -> Completion:
    """One single-turn completion of `prompt_ids` within `max_tokens` with orch `sampling`'s keys, continued
    across policy switches (`partial_turn`)."""
    return await partial_turn(switch, client, prompt_ids, max_tokens, temperature, seed,
                              extra_sampling(sampling, max_tokens))


def prompt_model(switch: Switch) -> str:
    """A model name the server detokenizes with (every adapter shares the base model's tokenizer)."""
    return switch.policy.base_model


class PartialTurns(Turns):
    """`rollout.Turns` with partial rollouts: every model turn of a multi-turn or tool rollout is a `partial_turn`
    (stopped at a policy switch and continued under the new policy; the environment takes no part within a turn),
    the first turn of the group's `n` rollouts as `n` requests, rollout i's seeded `seed + i`."""

    def __init__(self, switch: Switch, client: Any, temperature: float) -> None:
        super().__init__(client, switch.policy.base_model, temperature)
        self.switch = switch

    async def first(self, prompt_ids: list[int], n: int, max_tokens: int, seed: int | None,
                    extra: dict[str, Any]) -> list[Completion]:
        return await all_or_cancel([partial_turn(self.switch, self.client, prompt_ids, max_tokens, self.temperature,
                                                 None if seed is None else seed + i, extra) for i in range(n)])

    async def next(self, prompt_ids: list[int], max_tokens: int, seed: int | None,
                   extra: dict[str, Any]) -> Completion:
        return await partial_turn(self.switch, self.client, prompt_ids, max_tokens, self.temperature, seed, extra)


async def partial_group(switch: Switch, client: InferenceClient, prompt_ids: list[int], n: int,
                        sampling: SamplingSection, seq_len: int, seed: int | None, temperature: float,
                        on_done: Callable[[], None]) -> list[Completion]:
    """`rollout.split_group` with partial completions: `n` completions of one prompt, each its own request(s),
    `on_done` called once per completion however it ends; a failed request cancels the others and raises.
    Completion i is seeded `seed + i` (`seed` set)."""
    room = seq_len - len(prompt_ids)
    if room < 1:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room under seq_len {seq_len}")
    max_tokens = min(sampling.max_tokens or room, room)
    return await all_or_cancel([partial_completion(switch, client, prompt_ids, max_tokens, sampling, temperature,
                                                   None if seed is None else seed + i) for i in range(n)], on_done)


def token_staleness(step: int, groups: list[list[Completion]], starts: list[int]) -> dict[str, float]:
    """Batch `step`'s staleness per sampled token and of its longest completions: `staleness/token_mean` (over
    every sampled token, (step - 1) - the version that sampled it; a completion without `versions` is its group's
    start version throughout), `staleness/longest_decile` (the longest tenth of the completions, at least one:
    their mean staleness by oldest token, what `max_off_policy_steps` judges) and
    `staleness/longest_decile_token_mean` (the same completions, per token). Partial rollouts lower the per-token
    figures; the oldest-token one stays (module doc)."""
    rows = []  # (length, oldest-token staleness, sum of per-token staleness, sampled tokens)
    for comps, start in zip(groups, starts, strict=True):
        for c in comps:
            mask = np.ones(len(c.token_ids), dtype=bool) if c.mask is None else np.asarray(c.mask, dtype=bool)
            v = np.full(len(c.token_ids), start) if c.versions is None else np.asarray(c.versions)
            lag = np.maximum(0, (step - 1) - v[mask])
            rows.append((len(c.token_ids), max(0, step - 1 - start), float(lag.sum()), int(mask.sum())))
    if not rows:
        return {}
    rows.sort(key=lambda r: -r[0])
    top = rows[:max(1, len(rows) // 10)]
    return {"staleness/token_mean": sum(r[2] for r in rows) / max(1, sum(r[3] for r in rows)),
            "staleness/longest_decile": float(np.mean([r[1] for r in top])),
            "staleness/longest_decile_token_mean": sum(r[2] for r in top) / max(1, sum(r[3] for r in top))}


def newest_version(comps: list[Completion], start: int) -> int:
    """The newest policy version that sampled a token of `comps` (`start` when none records versions)."""
    return max([start, *(max(c.versions) for c in comps if c.versions)])


def refuse_whole_group(switch: Switch, images: list[bytes], env: Any) -> None:
    """Partial rollouts continue text turns that tidal samples: a group whose prompt holds images, or that a
    rollout function samples, is an error (the config check refuses rollout-function environments up front; images
    are seen only here)."""
    if not switch.on:
        return
    if images:
        raise ValueError("orch partial_rollouts: abort_resume continues text completions only, and a prompt holds "
                         "images: a continuation is a token prompt, which would need the images again (vLLM takes "
                         "them with a chat prompt only); set partial_rollouts: off for this run")
    if getattr(env, "rollout_func", None) is not None:
        raise ValueError(f"orch partial_rollouts: abort_resume does not combine with environment "
                         f"'{getattr(env, 'id', env)}', sampled by a rollout function: {ROLLOUT_FUNC_WHY}; set "
                         f"partial_rollouts: off for this run")


ROLLOUT_FUNC_WHY = ("the function returns its own token rows, which tidal cannot map back to the requests (and "
                    "policy versions) that sampled each token")
