"""The agent endpoint: an OpenAI- and Anthropic-compatible HTTP server with one base URL per session.

Served by uvicorn on the orchestrator's own event loop, bound to 127.0.0.1 (`AgentArgs.port`, default a free one).
Routes, per session `SID` (its random key in `Authorization: Bearer KEY`, as the OpenAI SDK sends it, or `x-api-key`,
as the Anthropic SDK does):
  GET  /s/SID/v1/models                 the one model name (`AgentArgs.model`)
  POST /s/SID/v1/chat/completions       OpenAI chat completions, streaming or not; `tools`, `tool_choice`
                                        (auto, none), `temperature`, `top_p`, `max_tokens` /
                                        `max_completion_tokens`, `stop`
  POST /s/SID/v1/messages               Anthropic messages, streaming or not; `system`, tool_use / tool_result
                                        blocks, `tool_choice` (auto, none), `temperature`, `top_p`,
                                        `max_tokens`, `stop_sequences`
  POST /s/SID/reward  {"reward": x}     the program's reward for its episode
An unknown session is answered 404, a wrong key 401. What would break the sampling contract or that tidal does not
do is answered 400 naming it: `n` > 1, a `logit_bias`, a `seed` (tidal seeds each call from orch `sampling.seed`:
`tidal.orchestrator.agentloop`), a model name that is not the policy, forced tool choices,
request keys the endpoint does not know, `parallel_tool_calls: false` (`user`, `metadata` and `store` are taken and
not used: they do not change sampling). Calls are sampled at most `max_concurrency` at once. The model's tool-call
text is parsed in its own format (`tidal.envs.tools.parse_tool_calls`) into `tool_calls` / `tool_use`; a turn whose
calls do not all parse is answered as plain text. A call's `tools` reach the model by `AgentArgs.tool_prompt`
(`tidal.envs.agent.toolprompt`): with `template` (default), tools the chat template ignores are answered 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tidal.envs.agent.session import Backend, Session, SessionFailed
from tidal.envs.agent.stream import AnthropicWriter, OpenAIWriter, Writer
from tidal.envs.agent.toolprompt import SystemToolsBackend, tools_ignored
from tidal.envs.agent.wire import (
    WireError,
    anthropic_answer,
    anthropic_messages,
    anthropic_tools,
    openai_answer,
    openai_messages,
    openai_tools,
)
from tidal.envs.splice import turn_text
from tidal.envs.tools import parse_tool_calls

log = logging.getLogger("tidal.agent")

OPENAI_KEYS = frozenset({"model", "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens",
                         "max_completion_tokens", "stop", "stream", "stream_options", "n", "logit_bias", "seed", "user",
                         "metadata", "store", "parallel_tool_calls"})
ANTHROPIC_KEYS = frozenset({"model", "messages", "system", "max_tokens", "tools", "tool_choice", "temperature",
                            "top_p", "stop_sequences", "stream", "metadata"})


def reply_message(c: Any, fmt: str, parse: bool) -> dict[str, Any]:
    """The assistant message of a sampled turn (template form): its tool calls parsed when they all parse."""
    content = turn_text(c)
    if parse:
        body, calls = parse_tool_calls(content, fmt)
        if calls and all(call.error is None for call in calls):
            return {"role": "assistant", "content": body,
                    "tool_calls": [call.message(f"call_{secrets.token_hex(8)}") for call in calls]}
    return {"role": "assistant", "content": content}


class AgentServer:
    """The sessions and the HTTP server in front of them (see the module doc)."""

    def __init__(self, model: str, tool_format: str, max_concurrency: int, port: int = 0,
                 tool_prompt: str = "template") -> None:
        self.model, self.fmt, self.port, self.tool_prompt = model, tool_format, port, tool_prompt
        self.ignored: dict[str, bool] = {}
        """Per tool list (JSON): whether the chat template renders the same tokens without it (`tool_prompt`
        template)."""
        self.sessions: dict[str, tuple[Session, Backend]] = {}
        self.max_concurrency = max_concurrency
        self.sem = asyncio.Semaphore(max_concurrency)
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._starting: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}
        self.calls: set[asyncio.Task[None]] = set()
        """Streamed calls being sampled (held so they finish even when their client has gone)."""

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def urls(self, session: Session) -> tuple[str, str]:
        """(the OpenAI base URL `.../v1`, the Anthropic base URL) of `session`."""
        return f"{self.root}/s/{session.id}/v1", f"{self.root}/s/{session.id}"

    async def ensure_started(self) -> None:
        """Serve on this event loop (again, when an earlier loop has gone); concurrent callers start it once."""
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._task is not None and not self._task.done():
            return
        async with self._starting.setdefault(loop, asyncio.Lock()):
            if self._loop is loop and self._task is not None and not self._task.done():
                return
            await self._start(loop)

    async def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        import uvicorn

        class Quiet(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:  # the orchestrator owns SIGINT / SIGTERM
                yield

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        self.sem = asyncio.Semaphore(self.max_concurrency)  # bound to this loop
        self._server = Quiet(uvicorn.Config(build_app(self), log_level="warning", lifespan="off"))
        self._task = loop.create_task(self._server.serve(sockets=[sock]))
        self._loop = loop
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        log.info("agent endpoint serving at %s/s/<session>/v1", self.root)

    async def stop(self) -> None:
        if self._server is not None and self._task is not None and not self._task.done():
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 10)

    def open(self, session: Session, backend: Backend) -> None:
        self.sessions[session.id] = (session, backend)

    def close(self, session: Session) -> None:
        self.sessions.pop(session.id, None)

    def find(self, sid: str, headers: Any) -> tuple[Session, Backend]:
        """The session `sid` if the request's key is its key; SessionFailed(404 / 401) otherwise."""
        found = self.sessions.get(sid)
        if found is None:
            raise SessionFailed(404, f"no agent session '{sid}' (it ended, or never existed): use the base URL the "
                                     f"program was given")
        auth = headers.get("authorization", "")
        key = auth[7:] if auth.lower().startswith("bearer ") else headers.get("x-api-key", "")
        if not hmac.compare_digest(key.encode(), found[0].key.encode()):
            raise SessionFailed(401, f"wrong API key for agent session '{sid}': use the key the program was given "
                                     f"(OPENAI_API_KEY / ANTHROPIC_API_KEY)")
        return found

    def check_model(self, body: dict[str, Any]) -> None:
        if body.get("model") != self.model:
            raise WireError(f"model {body.get('model')!r} is not served here: the policy being trained is "
                            f"{self.model!r} (agent args.model)")

    async def tool_backend(self, backend: Backend, messages: list[dict[str, Any]],
                           tools: list[dict[str, Any]] | None) -> Backend:
        """The backend that renders this call's `tools` by `tool_prompt` (module doc of
        `tidal.envs.agent.toolprompt`); WireError (400) when the template would drop them."""
        if not tools or self.tool_prompt == "program":
            return backend
        if self.tool_prompt == "system":
            return SystemToolsBackend(backend)
        key = json.dumps(tools, sort_keys=True)
        if key not in self.ignored:
            self.ignored[key] = await tools_ignored(backend, messages, tools)
            if self.ignored[key]:
                log.warning("agent endpoint: the chat template of %s ignores `tools`; calls with tools are answered "
                            "400 (agent args.tool_prompt: system or program)", getattr(backend, "model", self.model))
        if self.ignored[key]:
            served = getattr(backend, "model", None)
            raise WireError(
                f"the chat template of the model being trained ({served or self.model!r}) ignores `tools`: it renders "
                f"the same tokens with and without this request's tools, so the model would never see them (tidal "
                f"does not drop them silently). Set agent args.tool_prompt: system (tidal writes the tools into the "
                f"system message, Hermes <tool_call> style), or tool_prompt: program (your program's own prompt "
                f"describes its tools; tools= then only makes the endpoint parse the model's calls), or give the "
                f"model a chat template that renders tools (infer `chat_template`)")
        return backend

    async def complete(self, sid: str, headers: Any, body: dict[str, Any], kind: str,
                       on_text: Callable[[str, bool], None] | None = None) -> tuple[Any, dict[str, Any]]:
        """Parse one call (`kind`: openai or anthropic), sample it in its session; (completion, message).
        `on_text(text so far, tools parsed)`: called as the turn's text grows (a streamed call)."""
        session, backend = self.find(sid, headers)
        if not isinstance(body, dict):
            raise WireError("the request body must be a JSON object")
        self.check_model(body)
        known = OPENAI_KEYS if kind == "openai" else ANTHROPIC_KEYS
        unknown = sorted(set(body) - known)
        if unknown:
            raise WireError(f"request keys {unknown} are not supported by tidal's agent endpoint (supported: "
                            f"{sorted(known)})")
        if kind == "openai":
            if body.get("n", 1) != 1:
                raise WireError(f"n={body['n']}: tidal samples one completion per call (a group is "
                                f"rollouts_per_example sessions); call again instead")
            if body.get("parallel_tool_calls") is False:
                raise WireError("parallel_tool_calls=false: tidal answers every tool call the model writes in a turn "
                                "(leave it unset or true)")
            if body.get("logit_bias"):
                raise WireError("logit_bias changes the sampling distribution the trainer scores; tidal refuses it")
            if body.get("seed") is not None:
                raise WireError(f"seed={body['seed']!r}: tidal seeds every call itself, from orch sampling.seed "
                                f"(call k of the group's session i: seed + 7919 k + i, the tool loop's rule, so the "
                                f"group's sessions differ and a seeded run repeats); leave seed unset")
            messages, tools = openai_messages(body.get("messages")), openai_tools(body.get("tools"))
            stop = body.get("stop")
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        else:
            messages = anthropic_messages(body.get("system"), body.get("messages"))
            tools, stop, max_tokens = anthropic_tools(body.get("tools")), body.get("stop_sequences"), body.get(
                "max_tokens")
        choice = body.get("tool_choice")
        mode = choice if isinstance(choice, str) else (choice or {}).get("type", "auto")
        if mode not in ("auto", "none"):
            raise WireError(f"tool_choice {choice!r}: tidal samples the policy freely and cannot force a tool call "
                            f"(supported: auto, none)")
        params = {"temperature": body.get("temperature"), "top_p": body.get("top_p"),
                  "stop": [stop] if isinstance(stop, str) else stop or None}
        parse = bool(tools) and mode != "none"
        backend = await self.tool_backend(backend, messages, tools)
        grow = None if on_text is None else lambda text: on_text(text, parse)
        async with self.sem:
            return await session.call(backend, messages, tools, max_tokens, params,
                                      lambda c: reply_message(c, self.fmt, parse), grow)


def failure(server: AgentServer, sid: str, exc: BaseException) -> tuple[int, str]:
    """(status, message) of a call that failed: a refused request 400, a session's limit or key its own status,
    anything else (inference failed) 502, which also fails the episode."""
    if isinstance(exc, WireError):
        return 400, str(exc)
    if isinstance(exc, SessionFailed):
        return exc.status, str(exc)
    session = server.sessions.get(sid, (None,))[0]
    why = f"sampling failed: {type(exc).__name__}: {str(exc)[:500]}"
    if session is not None:
        session.failure = session.failure or why
    log.warning("agent session %s: %s", sid, why)
    return 502, why


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'openai' else 'msg'}-{secrets.token_hex(12)}"


def usage_of(session: Session, c: Any) -> dict[str, int]:
    n_in, n_out = session.last_prompt_len, len(c.token_ids)
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


async def streamed(server: AgentServer, sid: str, headers: Any, body: dict[str, Any], kind: str) -> Any:
    """A streamed call: sampled as a task whose text reaches the client as it grows (`tidal.envs.agent.stream`).
    A failure before the first token is answered with its status like a plain call; one after it ends the stream
    with an error event. The call completes (and is recorded in its row) even if the client goes away."""
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    async def call() -> None:
        try:
            done = await server.complete(sid, headers, body, kind, lambda text, tools: queue.put_nowait(
                ("text", (text, tools))))
            queue.put_nowait(("done", done))
        except Exception as exc:  # noqa: BLE001 - handed to the response
            queue.put_nowait(("error", exc))

    task = asyncio.get_running_loop().create_task(call())
    server.calls.add(task)
    task.add_done_callback(server.calls.discard)
    first = await queue.get()
    if first[0] == "error":
        raise first[1]
    call_id = new_id(kind)
    opts = body.get("stream_options") or {}
    session = server.sessions[sid][0]

    def writer(tools: bool) -> Writer:
        return (OpenAIWriter(server.model, call_id, tools, bool(opts.get("include_usage"))) if kind == "openai"
                else AnthropicWriter(server.model, call_id, tools))

    async def events() -> AsyncIterator[str]:
        item, w = first, None
        while True:
            what, value = item
            if what == "text":
                w = w or writer(value[1])
                for e in w.text(value[0], session.last_prompt_len):
                    yield e
            elif what == "done":
                c, message = value
                w = w or writer(bool(message.get("tool_calls")))
                for e in w.finish(message, c.finish_reason, usage_of(session, c)):
                    yield e
                return
            else:
                w = w or writer(False)
                for e in w.error(*failure(server, sid, value)):
                    yield e
                return
            item = await queue.get()

    return StreamingResponse(events(), media_type="text/event-stream")


def openai_error(status: int, message: str) -> Any:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            429: "rate_limit_error"}.get(status, "api_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status)


def anthropic_error(status: int, message: str) -> Any:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            429: "rate_limit_error"}.get(status, "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status)


def build_app(server: AgentServer) -> Any:
    """The FastAPI app of `server` (see the module doc)."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    async def answer(sid: str, request: Request, kind: str) -> Any:
        error = openai_error if kind == "openai" else anthropic_error
        try:
            try:
                body = await request.json()
            except ValueError:
                raise WireError("the request body is not JSON") from None
            if isinstance(body, dict) and body.get("stream"):
                return await streamed(server, sid, request.headers, body, kind)
            c, message = await server.complete(sid, request.headers, body, kind)
        except Exception as exc:  # noqa: BLE001 - answered with the status it calls for (`failure`)
            return error(*failure(server, sid, exc))
        session = server.sessions[sid][0]
        make = openai_answer if kind == "openai" else anthropic_answer
        return JSONResponse(make(server.model, new_id(kind), message, c.finish_reason, usage_of(session, c)))

    @app.post("/s/{sid}/v1/chat/completions")
    async def chat(sid: str, request: Request) -> Any:
        return await answer(sid, request, "openai")

    @app.post("/s/{sid}/v1/messages")
    async def messages(sid: str, request: Request) -> Any:
        return await answer(sid, request, "anthropic")

    @app.get("/s/{sid}/v1/models")
    async def models(sid: str, request: Request) -> Any:
        try:
            server.find(sid, request.headers)
        except SessionFailed as exc:
            return openai_error(exc.status, str(exc))
        return {"object": "list", "data": [{"id": server.model, "object": "model", "created": 0,
                                            "owned_by": "tidal"}]}

    @app.post("/s/{sid}/reward")
    async def reward(sid: str, request: Request) -> Any:
        try:
            session, _ = server.find(sid, request.headers)
            value = (await request.json()).get("reward")
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise WireError(f"reward must be a number, got {value!r}")
        except SessionFailed as exc:
            return openai_error(exc.status, str(exc))
        except (WireError, ValueError, AttributeError) as exc:
            return openai_error(400, f"POST /reward takes {{\"reward\": <number>}}: {exc}")
        session.reward = float(value)
        return JSONResponse({"ok": True})

    return app
