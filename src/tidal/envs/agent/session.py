"""One agent session: its calls stitched into training rows, token for token.

A session is one rollout: a program's run
against its own base URL. Each model call carries the whole conversation (the API is stateless); the session keeps
its open row: the prompt ids, the completion ids so far (model tokens and spliced tokens), the per-token logprobs,
loss mask and policy versions, and the conversation they render (template form, `tidal.envs.agent.wire`). A call
*extends* the row when its messages are the row's conversation (the earlier messages and every assistant message
exactly as returned) followed by new messages (tool results, a user's follow-up), with the same tools, and the row's
last turn ended at its end-of-turn token. Then the call's prompt ids are the row's prompt ids + completion ids + the
rendered suffix of the new messages (`tidal.envs.splice`: the tool loop's rule), and the call is sampled from those
ids (token in). Otherwise (history rewritten or summarised, a side call with another system prompt, other tools, a
turn cut at `max_tokens` or a `stop` string, a turn that ended at a token the template does not end turns with) the
call starts a new row: a fork, counted. Sampled tokens get loss mask 1 with their logprobs; spliced tokens mask 0. A
call whose temperature or top_p differs from the run's is sampled as asked but its tokens are context (mask 0): the
trainer scores every token at the run's sampling distribution. Every row is trained (`AgentArgs.train_forks`), with
the session's reward and advantage (`tidal.orchestrator.agentloop.stitch`); the last row holds the final answer.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tidal.envs.agent.wire import canonical
from tidal.envs.splice import ToolTemplateError


class Backend(Protocol):
    """What a session samples with (the orchestrator's inference client bound to the group's policy and sampling
    settings: `tidal.orchestrator.agentloop`)."""

    async def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """Token ids of `messages` rendered with the generation prompt."""
        ...

    async def suffix(self, history: list[dict[str, Any]], new: list[dict[str, Any]], stop_id: int,
                     tools: list[dict[str, Any]] | None) -> list[int]:
        """The splice rule's tokens for `new` after `history` (`tidal.envs.splice.tool_suffix`)."""
        ...

    async def sample(self, prompt_ids: list[int], max_tokens: int, call: int, params: dict[str, Any],
                     on_text: Callable[[str], None] | None = None) -> Any:
        """One completion (`tidal.inference.protocol.Completion`) of `prompt_ids`; `params`: the call's
        `temperature`, `top_p`, `stop` (None: the run's); `on_text`: called with the text so far as tokens arrive
        (a streamed call; the same sampling request and tokens as without it)."""
        ...

    def on_policy(self, params: dict[str, Any]) -> bool:
        """Whether a call with these sampling parameters samples the distribution the trainer scores."""
        ...


class SessionFailed(Exception):
    """The session broke a limit (calls, tokens, context): answered with `status` and the episode fails."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Row:
    """One training row: a chain of calls each extending the one before."""

    prompt_ids: list[int]
    prompt_messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    """The conversation so far in template form (prompt messages, assistant messages as returned, new messages)."""
    open: bool = True
    """The last turn ended at an end-of-turn token: a call may extend it."""
    finish: str = "stop"
    stop_id: int = -1

    def extends(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
        n = len(self.history)
        return (self.open and tools == self.tools and len(messages) > n
                and [canonical(m) for m in messages[:n]] == [canonical(m) for m in self.history])


@dataclass
class CallRecord:
    """One model call of a session, as sampled."""

    prompt_ids: list[int]
    token_ids: list[int]
    messages: list[dict[str, Any]]
    """The call's messages (template form)."""
    extended: bool
    """Whether it extended the open row (else it started a row)."""


@dataclass
class Session:
    """One rollout's session (see the module doc)."""

    id: str
    example: dict[str, Any]
    max_calls: int
    max_tokens: int | None
    seq_len: int
    key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    rows: list[Row] = field(default_factory=list)
    calls: int = 0
    forks: int = 0
    off_policy_calls: int = 0
    sampled: int = 0
    reward: float | None = None
    """The reward the program reported (`POST .../reward` or a callable's return value)."""
    failure: str | None = None
    """Why the episode failed (a limit, the program's exit code, a timeout); None: it did not."""
    last_answer: str = ""
    last_prompt_len: int = 0
    log: list[CallRecord] = field(default_factory=list)
    """Every call, in order."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def call(self, backend: Backend, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   max_tokens: int | None, params: dict[str, Any],
                   reply: Callable[[Any], dict[str, Any]],
                   on_text: Callable[[str], None] | None = None) -> tuple[Any, dict[str, Any]]:
        """Sample one call's completion (token in), recording it in its row; returns the Completion and the
        assistant message `reply` made of it (template form: what the program must send back to extend the row).
        `on_text`: a streamed call's observer (`Backend.sample`)."""
        async with self.lock:
            if self.failure is not None:
                raise SessionFailed(409, f"session {self.id} has already failed: {self.failure}")
            if self.calls >= self.max_calls:
                self.failure = f"more than max_calls={self.max_calls} model calls"
                raise SessionFailed(429, f"session {self.id}: {self.failure}")
            row = self.rows[-1] if self.rows and self.rows[-1].extends(messages, tools) else None
            new, suffix = messages[len(row.history):] if row is not None else [], []
            if row is not None:
                try:
                    suffix = await backend.suffix(row.history, new, row.stop_id, tools)
                except ToolTemplateError:  # the turn did not end at a token the template ends turns with: a fork
                    row = None
            prompt = row.prompt_ids + row.ids + suffix if row is not None else await backend.render(messages, tools)
            room = self.seq_len - len(prompt)
            if self.max_tokens is not None:
                room = min(room, self.max_tokens - self.sampled)
            if room < 1:
                self.failure = (f"the conversation ({len(prompt)} tokens) fills seq_len {self.seq_len}"
                                if self.seq_len - len(prompt) < 1 else
                                f"the session used its max_session_tokens={self.max_tokens}")
                raise SessionFailed(400, f"session {self.id}: {self.failure}")
            self.last_prompt_len = len(prompt)
            c = await backend.sample(prompt, min(room, max_tokens or room), self.calls, params, on_text)
            self.calls += 1
            self.sampled += len(c.token_ids)
            self.log.append(CallRecord(prompt, list(c.token_ids), list(messages), row is not None))
            if row is None:
                self.forks += bool(self.rows)
                row = Row(prompt, list(messages), tools, history=list(messages))
                self.rows.append(row)
            else:
                row.ids += suffix
                row.logprobs += [0.0] * len(suffix)
                row.mask += [0] * len(suffix)
                row.versions += [None] * len(suffix)
                row.history += new
            trained = backend.on_policy(params)
            self.off_policy_calls += not trained
            row.ids += c.token_ids
            row.logprobs += c.logprobs if trained else [0.0] * len(c.token_ids)
            row.mask += [int(trained)] * len(c.token_ids)
            row.versions += [None] * len(c.token_ids) if c.versions is None else c.versions
            row.finish = c.finish_reason
            row.open = c.finish_reason == "stop" and bool(c.token_ids) and not params.get("stop")
            row.stop_id = c.token_ids[-1] if c.token_ids else -1
            message = reply(c)
            row.history.append(message)
            self.last_answer = message["content"]
            return c, message
