"""One OpenEnv episode per rollout, behind the tool loop's session interface (`tidal.orchestrator.toolloop`).

The loop samples each model turn from the exact token ids so far (ending at the end-of-turn token) and hands the
turn, as an assistant message, to the session's `after_turn`. Here that turn is the action:
- the first call opens the rollout's WebSocket session (openenv-core's `GenericEnvClient`, one server-side
  environment instance per session) and sends `reset(seed)` with the example's seed; the first observation must
  render to the prompt the model was given (a group shares one prompt: `reset` must be deterministic in its seed);
- the turn's text becomes the action (`{action_field: text}`, or `action_parser(text)`) and is sent as `step`;
- the step's observation comes back as a user message (rendered by `render_observation`), whose tokens the loop
  splices in from the chat template with no loss; None ends the rollout: the server said `done`, `max_turns`
  actions were taken, the action was invalid, or the server failed.
The rollout's `Episode` (observations, actions, step rewards, how it ended) is what the environment scores and what
reward functions get in `environments`.

Failures of the server (refused connections, server-side errors, timeouts, a dropped connection, a `reset` that does
not reproduce the prompt) end the episode with `Episode.error` set: the rollout failed on the environment's side
(`OpenEnvSession.env_error`, `Completion.env_error`), was not judged, carries no loss and stays out of its group's
baseline; when most of a step's episodes fail so, the orchestrator waits the outage out
(`tidal.orchestrator.outage`). A `step` that fails after the model's action is the model's doing when the server's
`/health` still answers at that moment (`args.action_failures: model`, the default: an action that hangs or breaks
the environment must not escape its penalty): the episode ends with `Episode.action_failure` set and scores
`args.action_failure_reward`, trained on; with `/health` failing too, or with `action_failures: environment`, it
is the environment's as above. An action the server's Action model rejects (or that `action_parser` refuses) is
the model's doing, not a failure: the episode ends there (`Episode.invalid_action`) with the rewards it had.

A session holds one of `max_sessions` slots from its first `after_turn` until it closes: when the episode ends, or
when the rollout's task ends for any other reason (a truncated turn, an error in the loop: a done-callback on the
task closes it), so a server's capacity is never leaked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("tidal.orch")

CODE = re.compile(r"\(code: ([A-Z_]+)\)")


class ObservationError(ValueError):
    """An observation cannot be rendered with `observation_template`."""


class InvalidAction(ValueError):
    """The model's turn is not a valid action (the parser refused it, or the server's Action model)."""


def render_observation(obs: dict[str, Any], template: str | None) -> str:
    """The user message of an observation's fields (without `reward`, `done`, `metadata`): `template.format(**obs)`;
    without a template its only string field, or else all its fields as JSON (sorted keys)."""
    if template is not None:
        try:
            return template.format_map(obs)
        except (KeyError, IndexError, ValueError, AttributeError) as exc:
            raise ObservationError(f"observation_template {template!r} does not fit the observation "
                                   f"({type(exc).__name__}: {exc}; its fields: {', '.join(sorted(obs)) or 'none'})"
                                   ) from None
    strings = [v for v in obs.values() if isinstance(v, str)]
    if len(strings) == 1:
        return strings[0]
    return json.dumps(obs, sort_keys=True, default=str)


def turn_text(message: dict[str, Any]) -> str:
    """An assistant turn's text as the model wrote it: its content, and any `<tool_call>` blocks the loop parsed out of
    it put back as JSON (the action is the whole turn)."""
    text = str(message.get("content") or "")
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {})
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except json.JSONDecodeError:
            args = fn.get("arguments")
        text += f"<tool_call>{json.dumps({'name': fn.get('name'), 'arguments': args})}</tool_call>"
    return text


@dataclass
class Episode:
    """One rollout's episode: what reward functions get in `environments`."""

    seed: int
    observations: list[dict[str, Any]] = field(default_factory=list)
    """The reset's observation, then each step's (their fields, without reward/done/metadata)."""
    actions: list[dict[str, Any]] = field(default_factory=list)
    rewards: list[float | None] = field(default_factory=list)
    """Each step's reward as the server gave it (None: it gave none)."""
    done: bool = False
    """The server ended the episode."""
    error: str | None = None
    """Why the server failed this episode (then it scores NaN: a failed reward); None: it did not."""
    invalid_action: str | None = None
    """Why the last turn was not a valid action (the episode ended there)."""
    action_failure: str | None = None
    """Why the step of the last action failed while the server stayed healthy (the model's failure: the episode
    ended there and scores `args.action_failure_reward`)."""

    def total(self, mode: str, action_failure_reward: float = 0.0) -> float:
        """The episode's reward: NaN after a server failure; `action_failure_reward` after an action that failed
        its step; else the `sum` or the `last` of its step rewards (None counts as 0; no step: 0)."""
        if self.error is not None:
            return float("nan")
        if self.action_failure is not None:
            return action_failure_reward
        values = [float(r) if r is not None else 0.0 for r in self.rewards]
        if not values:
            return 0.0
        return values[-1] if mode == "last" else float(sum(values))


class Slots:
    """`max_sessions` WebSocket sessions at once, per event loop (a test may run several loops one after another)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.loop: asyncio.AbstractEventLoop | None = None
        self.sem: asyncio.Semaphore | None = None

    def get(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self.sem is None or self.loop is not loop:
            self.loop, self.sem = loop, asyncio.Semaphore(self.n)
        return self.sem


async def close_session(client: Any) -> None:
    """Close a `GenericEnvClient`'s session the way its server expects: send `close` and wait for the server to
    close the connection. (openenv-core 0.3.0's own `close()` closes the socket right after sending `close`, and the
    server then logs an "Exception in ASGI application" for every session; this uses the client's `_send` / `_ws`,
    and falls back to `close()` where they are missing.)"""
    ws = getattr(client, "_ws", None)
    send = getattr(client, "_send", None)
    try:
        if ws is not None and send is not None:
            await send({"type": "close"})
            await ws.wait_closed()
    finally:
        await client.close()


class OpenEnvTooling:
    """The tool loop's view of an OpenEnv environment: no tool schemas, one `OpenEnvSession` per rollout."""

    schemas = None
    fmt = "hermes"  # the loop parses `<tool_call>` blocks out of a turn; `turn_text` puts them back
    max_iterations = None  # the session ends the rollout (done, max_turns)
    env_type = None
    has_reward = False  # the environment scores the episodes itself (no extra reward column)

    def __init__(self, env: Any) -> None:
        self.env = env
        """The `OpenEnv` environment (its server, args, failure log)."""
        self.slots = Slots(env.args.max_sessions)
        self.closing: set[asyncio.Task[None]] = set()

    def open(self, row: dict[str, Any]) -> OpenEnvSession:
        prompt = row["prompt"]
        return OpenEnvSession(self, int(row["openenv_seed"]), str(prompt[-1]["content"]), row.get("openenv_error"))


class OpenEnvSession:
    """One rollout's WebSocket session with the server (see the module docs)."""

    observation = None  # the prompt already holds the first observation (drawn by `OpenEnv.sample`)

    def __init__(self, tooling: OpenEnvTooling, seed: int, expected: str, error: str | None) -> None:
        self.tooling, self.args = tooling, tooling.env.args
        self.expected = expected
        self.episode = Episode(seed, error=error)
        self.environment = self.episode
        self.client: Any = None
        self.sem: asyncio.Semaphore | None = None

    @property
    def env_error(self) -> str | None:
        """Why the server failed this episode (naming the server), or None: the rollout's `Completion.env_error`."""
        error = self.episode.error
        return None if error is None else f"OpenEnv environment at {self.tooling.env.server.base_url}: {error}"

    async def after_turn(self, history: list[dict[str, Any]], calls: list[Any]) -> list[dict[str, Any]] | None:
        """Step the last assistant turn of `history` as the action; the next observation as a user message, or
        None when the episode is over (the session is closed then)."""
        reply = await self.turn(history[-1])
        if reply is None:
            await self.end()
        return reply

    async def turn(self, message: dict[str, Any]) -> list[dict[str, Any]] | None:
        ep = self.episode
        if ep.error is not None or ep.done or ep.invalid_action is not None:
            return None
        try:
            if self.client is None:
                await self.begin()
                if ep.done or ep.error is not None:
                    return None
            action = self.tooling.env.action(turn_text(message))
            ep.actions.append(action)
            try:
                payload = await self.request(self.client.step(action), "step")
            except InvalidAction:
                raise
            except Exception as exc:  # noqa: BLE001 - after the action: whose failure is it?
                await self.charge(f"{type(exc).__name__}: {exc}")
                return None
            ep.observations.append(payload["observation"])
            ep.rewards.append(payload["reward"])
            ep.done = bool(payload["done"])
            if ep.done or len(ep.actions) >= self.args.max_turns:
                return None
            return [{"role": "user", "content": render_observation(payload["observation"],
                                                                   self.args.observation_template)}]
        except InvalidAction as exc:
            ep.invalid_action = str(exc)
            self.tooling.env.note("invalid action", str(exc))
        except Exception as exc:  # noqa: BLE001 - a failing server fails the episode, never the run
            ep.error = f"{type(exc).__name__}: {exc}"
            self.tooling.env.note("server failure", ep.error)
        return None

    async def charge(self, what: str) -> None:
        """A step failed after the model's action: the model's failure while the server's `/health` answers
        (`args.action_failures: model`), else the environment's (module doc)."""
        env = self.tooling.env
        if self.args.action_failures == "model":
            down = await asyncio.to_thread(env.unavailable)
            if down is None:
                self.episode.action_failure = what
                env.note("action failure", what)
                return
            what = f"{what}; its health probe failed too: {down}"
        self.episode.error = what
        env.note("server failure", what)

    async def begin(self) -> None:
        """Take a slot, connect and `reset(seed)`; the first observation must be the prompt's."""
        from openenv.core import GenericEnvClient

        task = asyncio.current_task()
        if task is not None:  # close the session however the rollout's task ends
            task.add_done_callback(self._task_done)
        sem = self.tooling.slots.get()
        await sem.acquire()
        self.sem = sem
        timeout = self.args.timeout_s
        self.client = GenericEnvClient(base_url=self.tooling.env.server.base_url, connect_timeout_s=timeout,
                                       message_timeout_s=timeout)
        payload = await self.request(self.client.reset(seed=self.episode.seed, **self.args.reset_args), "reset")
        self.episode.observations.append(payload["observation"])
        self.episode.done = bool(payload["done"])
        first = render_observation(payload["observation"], self.args.observation_template)
        if first != self.expected:
            self.episode.error = (f"reset(seed={self.episode.seed}) gave another first observation than the one the "
                                  f"model was prompted with ({first[:80]!r} vs {self.expected[:80]!r}): a group "
                                  f"shares one prompt, so the environment's reset must be deterministic in its seed")
            self.tooling.env.note("server failure", self.episode.error)

    async def request(self, call: Any, what: str) -> dict[str, Any]:
        """A reset or step's `{observation, reward, done}`, within `timeout_s`; InvalidAction when the server's
        Action model rejected a step."""
        try:
            result = await asyncio.wait_for(call, self.args.timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{what} took over {self.args.timeout_s:g} s (args.timeout_s)") from None
        except RuntimeError as exc:  # openenv-core's client: "Server error: MESSAGE (code: CODE)"
            code = CODE.search(str(exc))
            if what == "step" and code is not None and code.group(1) == "VALIDATION_ERROR":
                raise InvalidAction(f"the server's Action model rejected it: {exc}") from None
            if code is not None and code.group(1) == "CAPACITY_REACHED":
                raise RuntimeError(f"{exc}; the server takes fewer sessions than args.max_sessions "
                                   f"({self.args.max_sessions}): lower it, or raise its max_concurrent_envs") from None
            raise
        return {"observation": dict(result.observation or {}), "reward": result.reward, "done": bool(result.done)}

    async def end(self) -> None:
        """Close the session and give back its slot (idempotent)."""
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(close_session(client), 5)
        sem, self.sem = self.sem, None
        if sem is not None:
            sem.release()
        return None

    def _task_done(self, task: asyncio.Future[Any]) -> None:
        if self.client is None and self.sem is None:
            return
        closing = task.get_loop().create_task(self.end())
        self.tooling.closing.add(closing)
        closing.add_done_callback(self.tooling.closing.discard)

