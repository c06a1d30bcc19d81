"""A group of the `agent` environment: `n` runs of the user's program, each a session, stitched into `n` rollouts.

The sessions sample through `ClientBackend`: the group's policy on the inference client, token in, the house's splice
rule for extending calls (`tidal.envs.splice`), the run's sampling keys (`sampling`, the step's temperature; a call
asking for another temperature or top_p is sampled so, its tokens context only: `tidal.envs.agent.session`), each
call capped at `sampling.max_tokens` and what `seq_len` leaves, special tokens kept in the text (tool-call markers).
A call that starts a row is rendered once per group for the same messages and tools (the `n` sessions of an example
usually open alike). With `sampling.seed`, call k of session i is seeded `seed + 7919 * k + i` (`rollout.turn_seed`,
the tool loop's rule: a session that makes the tool loop's calls samples its tokens); a `seed` in a call is refused
(400), as the group's sessions would then sample alike. Model turns go through the group's `Turns` (partial rollouts:
`PartialTurns`, which continues a turn across a policy switch), so staleness, in-flight and
partial-rollout rules apply as to any rollout. A streamed call (`stream: true`) is sampled as a streamed request of
the same sampling keys (`VllmClient.sample_stream`, `ClientBackend.streams`), its text handed to the endpoint as it
arrives (`tidal.envs.agent.stream`).

Stitching: a session is one rollout; its last row (`Session.rows[-1]`, the one holding the final answer) is the
rollout's completion. A group trains against one prompt, so the group's prompt is the longest common prefix of those
rows' prompts and each row's own rest of prompt goes before its completion tokens with loss mask 0 (context, never
re-tokenized). The session's earlier rows (forks: calls that did not extend the conversation) are training rows of
their own (`Completion.extra_rows`, each with its whole prompt), scored with the session: every row of a session
gets the session's reward and the group advantage of the session (as AReaL and verifiers do; agent args
`train_forks: false` leaves them out). A failed session (`Session.failure`) becomes a rollout with `env_error` (no
loss, not judged, no extra rows); one that made no call has no tokens.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from tidal.config.orch import SamplingSection
from tidal.envs.agent import AgentEnv
from tidal.envs.agent.session import Row, Session
from tidal.envs.base import Example
from tidal.envs.splice import tool_suffix
from tidal.inference.protocol import Completion, InferenceClient
from tidal.orchestrator.rollout import Turns, fill_versions, turn_seed
from tidal.orchestrator.sampling import extra_sampling


class ClientBackend:
    """What the sessions of one group sample with (`tidal.envs.agent.session.Backend`)."""

    def __init__(self, client: InferenceClient, turns: Turns, sampling: SamplingSection, temperature: float,
                 seed: int | None, index: int, renders: dict[str, asyncio.Future[list[int]]] | None = None) -> None:
        self.client, self.turns, self.sampling, self.temperature = client, turns, sampling, temperature
        self.seed, self.index = seed, index
        self.renders: dict[str, asyncio.Future[list[int]]] = {} if renders is None else renders
        """Renderings by (messages, tools), shared by the group's sessions: the `n` sessions of one example usually
        open with the same messages, which the server then renders once, not `n` times."""

    @property
    def model(self) -> str:
        """The policy's name on the inference server (named in the endpoint's errors)."""
        return self.turns.model

    async def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        key = json.dumps([messages, tools], sort_keys=True)
        task = self.renders.get(key)
        if task is None:
            task = self.renders[key] = asyncio.ensure_future(
                self.client.tokenize_chat(self.turns.model, messages, tools, add_generation_prompt=True))
        try:
            return list(await asyncio.shield(task))  # one session cancelled does not cancel the others' rendering
        except Exception:
            if self.renders.get(key) is task:
                del self.renders[key]  # a failed rendering is asked again by the next call
            raise

    async def suffix(self, history: list[dict[str, Any]], new: list[dict[str, Any]], stop_id: int,
                     tools: list[dict[str, Any]] | None) -> list[int]:
        return await tool_suffix(self.client, self.turns.model, history, new, stop_id, tools)

    def on_policy(self, params: dict[str, Any]) -> bool:
        t, p = params.get("temperature"), params.get("top_p")
        return (t is None or float(t) == self.temperature) and (p is None or float(p) == self.sampling.top_p)

    async def sample(self, prompt_ids: list[int], max_tokens: int, call: int, params: dict[str, Any],
                     on_text: Callable[[str], None] | None = None) -> Completion:
        max_tokens = min(max_tokens, self.sampling.max_tokens or max_tokens)
        extra: dict[str, Any] = {**extra_sampling(self.sampling, max_tokens), "skip_special_tokens": False}
        if params.get("stop"):
            extra["stop"] = list(params["stop"])
        seed = turn_seed(self.seed, call, self.index)
        on_policy = self.on_policy(params)
        temp = self.temperature if params.get("temperature") is None else float(params["temperature"])
        if not on_policy and params.get("top_p") is not None:
            extra["top_p"] = float(params["top_p"])
        if on_text is not None and self.streams():
            def until(text: str, _: int) -> bool:
                on_text(text)
                return False  # an observer: the turn ends where vLLM ends it

            return await self.client.sample_stream(self.turns.model, prompt_ids, max_tokens,  # type: ignore[attr-defined]
                                                   temp, asyncio.Event(), seed, extra, until)
        if on_policy:
            return await self.turns.next(prompt_ids, max_tokens, seed, extra)
        return (await self.client.sample(self.turns.model, prompt_ids, 1, max_tokens, temp, seed, extra))[0]

    def streams(self) -> bool:
        """Whether a streamed call is sampled as a streamed request (token by token): on a client that streams,
        with each turn one request (`Turns`; partial rollouts continue a turn across policy switches, and a
        call then streams once its turn is sampled) and no routed experts asked for (they come with whole
        answers only)."""
        return (type(self.turns) is Turns and hasattr(self.client, "sample_stream")
                and not getattr(self.client.cfg, "return_routed_experts", False))


async def agent_group(client: InferenceClient, model: str, prompt_ids: list[int], n: int, sampling: SamplingSection,
                      seq_len: int, seed: int | None, temperature: float, env: AgentEnv, example: Example,
                      turns: Turns | None = None) -> list[Completion]:
    """`n` sessions of `example` run by the environment's program, as `n` rollouts (module doc)."""
    how = turns or Turns(client, model, temperature)
    sessions = [env.new_session(example, seq_len) for _ in range(n)]
    renders: dict[str, asyncio.Future[list[int]]] = {}
    await asyncio.gather(*(env.run_session(s, ClientBackend(client, how, sampling, temperature, seed, i, renders))
                           for i, s in enumerate(sessions)))
    env.stop_if_broken()
    return stitch(sessions, prompt_ids, env.args.train_forks)


def common_prefix(rows: list[list[int]]) -> list[int]:
    first = rows[0]
    k = min(len(r) for r in rows)
    for i in range(k):
        if any(r[i] != first[i] for r in rows):
            return first[:i]
    return first[:k]


def stitch(sessions: list[Session], prompt_ids: list[int], train_forks: bool = True) -> list[Completion]:
    """The sessions' rows as rollouts of one prompt (module doc); `prompt_ids`: the example's prompt, used when no
    session made a call; `train_forks`: a session's earlier rows ride along as `Completion.extra_rows`."""
    prompts = [s.rows[-1].prompt_ids for s in sessions if s.rows]
    prompt = common_prefix(prompts) if prompts else list(prompt_ids)
    if not prompt:
        raise ValueError("agent: the sessions' first prompts share no token (their chat templates' renderings start "
                         "differently); tidal trains a group against one prompt")
    out = []
    for s in sessions:
        if not s.rows:
            out.append(Completion([], [], "", "stop", None, [], messages=[], environment=s, env_error=why(s),
                                  prompt_ids=prompt))
            continue
        row = s.rows[-1]
        rest = row.prompt_ids[len(prompt):]
        vers = [None] * len(rest) + row.versions
        forks = [fork_row(r) for r in s.rows[:-1]] if train_forks and s.failure is None else []
        out.append(Completion(rest + row.ids, [0.0] * len(rest) + row.logprobs, s.last_answer, row.finish, None,
                              [0] * len(rest) + row.mask, messages=row.history[len(row.prompt_messages):],
                              environment=s, env_error=why(s), prompt_ids=prompt,
                              versions=fill_versions(vers), extra_rows=forks or None))
    return out


def fork_row(row: Row) -> Completion:
    """A session's earlier row as a training row of its own: its whole prompt, its tokens (model tokens mask 1 with
    their logprobs, spliced tokens mask 0), its text the last assistant message of its conversation."""
    text = next((m.get("content") or "" for m in reversed(row.history) if m["role"] == "assistant"), "")
    return Completion(list(row.ids), list(row.logprobs), text, row.finish, None, list(row.mask),
                      messages=row.history[len(row.prompt_messages):], prompt_ids=list(row.prompt_ids),
                      versions=fill_versions(list(row.versions)))


def why(s: Session) -> str | None:
    """A failed session's `env_error` (naming the agent program), or None."""
    return None if s.failure is None else f"agent program, session {s.id}: {s.failure}"
