"""The tool-calling loop: `n` rollouts of one prompt in the model's own chat format, token in, token out.

For an environment with `tooling` (`tidal.envs.tools.Tooling`): the prompt was rendered with the tools' schemas
(`InferenceClient.tokenize_prompt(..., tools)`); each rollout gets its own `ToolSession` (a fresh
`environment_factory` instance, `reset(**row)` with the example's columns). Every model turn is sampled from the
exact token ids so far and ends at the end-of-turn token (EOS); its text is parsed for tool calls in the
environment's format; the calls run and their results become `tool` messages (a session's `after_turn`: a
verifiers environment may answer with other messages too). The tokens of those messages are
what the chat template renders after the assistant turn, by the house's one splice rule (`tidal.envs.splice`:
the tokens after the k-th end-of-turn token, k counted in the rendering without them); earlier turns are never
re-tokenized, the model's own
tokens stay as sampled. Tool tokens get loss mask 0 and logprob 0 (and, when the model turns carry policy versions
under orch `partial_rollouts`, the version of the model token before them: `rollout.fill_versions`). Each model
turn is sampled through a `rollout.Turns` (partial rollouts: `tidal.orchestrator.partial.PartialTurns`). The
loop ends when the session has no answer (for tools: the turn called none), ends otherwise than at EOS (the token
budget), after `max_iterations` tool rounds, or when the tool results
would not fit the budget (they are then left out, finish `length`).

A session whose environment failed on its own side (`env_error`: an OpenEnv server, a tool raising
`tidal.rewards.ServiceUnavailable`) ends the rollout, which carries the reason in `Completion.env_error`.
A rollout's `Completion` carries its `messages` (assistant turns with `tool_calls`, the answers: what reward
functions get as the completion), its session's `environment`, and as `text` the model turns with each answer as a
`[ROLE NAME] CONTENT` line between them (what an environment's own `reward` and the samples log see).

Simplification: a group shares one prompt, so an environment's `reset` must return the same observation for the
`n` rollouts of an example (it usually depends on the row only); different ones are an error.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tidal.config.orch import SamplingSection
from tidal.envs.base import Environment, Example
from tidal.envs.splice import tool_suffix, turn_text
from tidal.envs.tools import ToolCall, Tooling, parse_tool_calls
from tidal.inference.protocol import Completion, InferenceClient
from tidal.orchestrator.rollout import Turns, fill_versions, turn_seed
from tidal.orchestrator.sampling import extra_sampling


def with_observation(prompt: list[dict[str, Any]], observation: str | None) -> list[dict[str, Any]]:
    """The prompt with `observation` appended to its last message's content (TRL's `reset` contract)."""
    if observation is None:
        return list(prompt)
    last = prompt[-1]
    return [*prompt[:-1], {**last, "content": f"{last.get('content') or ''}{observation}"}]


def assistant_message(content: str, calls: list[ToolCall], round_: int) -> dict[str, Any]:
    """The assistant message of a turn, with its `tool_calls` (ids `c{round}{index}`, 9 characters, as Mistral's
    templates require)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [c.message(f"c{round_:04d}{k:04d}") for k, c in enumerate(calls)]
    return msg


async def one_rollout(client: InferenceClient, model: str, prompt_ids: list[int], messages: list[dict[str, Any]],
                      first: Completion, session: Any, tooling: Tooling, budget: int,
                      sample_next: Any) -> Completion:
    """Continue one sampled first turn through its tool rounds (see the module docs)."""
    ids: list[int] = []
    lps: list[float] = []
    mask: list[int] = []
    vers: list[int | None] = []
    history, out_msgs, texts = list(messages), [], []
    c, finish, round_ = first, first.finish_reason, 0
    while True:
        ids, lps, mask = ids + c.token_ids, lps + c.logprobs, mask + [1] * len(c.token_ids)
        vers += [None] * len(c.token_ids) if c.versions is None else c.versions
        finish = c.finish_reason
        content = turn_text(c)
        body, calls = parse_tool_calls(content, tooling.fmt)
        msg = assistant_message(body if calls else content, calls, round_)
        history.append(msg)
        out_msgs.append(msg)
        texts.append(content)
        capped = tooling.max_iterations is not None and round_ >= tooling.max_iterations
        if finish != "stop" or not c.token_ids or capped:
            break
        results = await session.after_turn(history, calls)
        if not results:
            break
        ids_of_calls = iter(tc["id"] for tc in msg.get("tool_calls", []))
        for r in results:  # tool results answer the turn's calls in order
            if r["role"] == "tool" and "tool_call_id" not in r:
                r["tool_call_id"] = next(ids_of_calls, "")
        suffix = await tool_suffix(client, model, history, results, c.token_ids[-1], tooling.schemas)
        room = budget - len(ids) - len(suffix)
        if room < 1:
            finish = "length"
            break
        history += results
        out_msgs += results
        texts += [f"\n[{r['role']} {r.get('name', '')}] {r.get('content', '')}\n" for r in results]
        ids, lps, mask = ids + suffix, lps + [0.0] * len(suffix), mask + [0] * len(suffix)
        vers += [None] * len(suffix)
        round_ += 1
        c = await sample_next(prompt_ids + ids, room, round_)
    return Completion(ids, lps, "".join(texts), finish, None, mask, messages=out_msgs,
                      environment=session.environment, env_error=getattr(session, "env_error", None),
                      versions=fill_versions(vers))


async def tool_group(client: InferenceClient, model: str, prompt_ids: list[int], n: int, sampling: SamplingSection,
                     seq_len: int, seed: int | None, temperature: float, env: Environment,
                     example: Example, turns: Turns | None = None) -> list[Completion]:
    """`n` tool-calling rollouts of `example` (whose prompt, rendered with the tools, is `prompt_ids`); `turns`:
    how each model turn is sampled (default: one request per turn on `model`)."""
    tooling: Tooling = env.tooling
    if isinstance(example.prompt, str):
        raise ValueError(f"environment '{env.id}': tools need conversational prompts (chat messages), got a string")
    row = {"prompt": example.prompt, **env.reward_columns(example)}
    sessions = [tooling.open(row) for _ in range(n)]
    observations = {s.observation for s in sessions}
    if len(observations) > 1:
        raise ValueError(f"environment_factory {tooling.env_type.__name__ if tooling.env_type else ''}: reset() "
                         f"returned different observations for the {n} rollouts of one example; tidal samples a "
                         f"group from one prompt, so reset must depend on the row only")
    messages = with_observation(example.prompt, sessions[0].observation)
    how = turns or Turns(client, model, temperature)
    override = None
    if sessions[0].observation is not None:
        prompt_ids = override = await client.tokenize_chat(how.model, messages, tooling.schemas)
    budget = min(sampling.max_tokens or seq_len, seq_len - len(prompt_ids))
    if budget < 1:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room under seq_len {seq_len}")
    extra = {**extra_sampling(sampling, budget), "skip_special_tokens": False}
    first = await how.first(prompt_ids, n, budget, seed, extra)

    def sampler(i: int) -> Any:
        async def sample_next(ids: list[int], room: int, round_: int) -> Completion:
            return await how.next(ids, room, turn_seed(seed, round_, i), {**extra, "min_tokens": 0})
        return sample_next

    out = list(await asyncio.gather(*(one_rollout(client, how.model, prompt_ids, messages, c, s, tooling, budget,
                                                  sampler(i))
                                      for i, (c, s) in enumerate(zip(first, sessions, strict=True)))))
    for c in out:
        c.prompt_ids = override
    return out
