"""Environments out of process: an HTTP environment server, and the client that stands in for it.

`tidal env-server ID [--args JSON] [--host H] [--port P]` serves any registered environment (or
`package.module:Class`) over HTTP with JSON bodies (no pickle):
  GET  /info                                  -> {id, max_turns, stop, has_reward}
  POST /sample  {seed}                         -> example (drawn with `random.Random(seed)`)
  POST /reward  {example, completion}          -> {reward}
  POST /respond {example, transcript}          -> {reply}  (multi-turn; null ends the rollout)
  POST /step_rewards {example, completion}     -> {steps}
  POST /eval_examples {}                       -> {examples} or {examples: null}
The orchestrator uses it through `RemoteEnvironment` when `env[].address` is set, or spawns one itself with
`env[].spawn: true` (a subprocess on a free localhost port, stopped with the orchestrator). The sampler's RNG
stays in the orchestrator: each example is drawn from a seed it takes from that RNG, so runs (and resumes)
stay reproducible. A server that cannot be reached, times out or answers 5xx raises
`tidal.rewards.ServiceUnavailable` in the client: the rollouts it concerns are not judged, and an orchestrator
waits out an outage (`tidal.orchestrator.outage`, probing `/info`). The server binds to 127.0.0.1 unless told
otherwise. Image parts of prompts (PIL images, files) travel as PNG data URLs (`example_to_json`).
"""

from __future__ import annotations

import atexit
import json
import random
import sys
import time
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from tidal.envs.base import Environment, Example
from tidal.envs.images import has_images, openai_messages
from tidal.procs import Child, free_port
from tidal.rewards import ServiceUnavailable


def example_to_json(example: Example) -> dict[str, Any]:
    """The example as JSON-able data; image parts (PIL images, files) travel as PNG data URLs."""
    prompt = example.prompt
    return {**asdict(example), "prompt": openai_messages(prompt) if has_images(prompt) and not isinstance(
        prompt, str) else prompt}


def example_from_json(d: dict[str, Any]) -> Example:
    prompt = d["prompt"]
    return Example(prompt=prompt if isinstance(prompt, str) else list(prompt), answer=str(d.get("answer", "")),
                   info=dict(d.get("info", {})), task=str(d.get("task", "")))


API_KEY_VAR = "TIDAL_ENV_API_KEY"


def make_handler(env: Environment, api_key: str | None = None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:  # quiet
            return

        def _authorized(self) -> bool:
            if api_key and self.headers.get("Authorization") != f"Bearer {api_key}":
                self._send(401, {"error": "missing or wrong API key"})
                return False
            return True

        def _send(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if not self._authorized():
                return
            if self.path == "/info":
                self._send(200, {"id": env.id, "max_turns": env.max_turns, "stop": list(env.stop),
                                 "has_reward": env.has_reward})
            else:
                self._send(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            if not self._authorized():
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path == "/sample":
                    out: Any = example_to_json(env.sample(random.Random(int(body["seed"]))))
                elif self.path == "/reward":
                    out = {"reward": env.reward(example_from_json(body["example"]), str(body["completion"]))}
                elif self.path == "/respond":
                    out = {"reply": env.respond(example_from_json(body["example"]), str(body["transcript"]))}
                elif self.path == "/step_rewards":
                    out = {"steps": env.step_rewards(example_from_json(body["example"]), str(body["completion"]))}
                elif self.path == "/eval_examples":
                    ex = env.eval_examples()
                    out = {"examples": None if ex is None else [example_to_json(e) for e in ex]}
                else:
                    self._send(404, {"error": f"no route {self.path}"})
                    return
            except Exception as exc:  # noqa: BLE001 - reported to the client, which raises it
                self._send(500, {"error": f"{type(exc).__name__}: {exc}"})
                return
            self._send(200, out)

    return Handler


def serve(env: Environment, host: str, port: int) -> None:
    """Serve `env` until killed. Beyond loopback an API key (TIDAL_ENV_API_KEY) is required."""
    import os

    key = os.environ.get(API_KEY_VAR)
    if host not in ("127.0.0.1", "localhost", "::1") and not key:
        raise PermissionError(f"refusing to serve environment '{env.id}' on {host} without an API key; set "
                              f"{API_KEY_VAR} (clients send it too) or bind to 127.0.0.1")
    server = ThreadingHTTPServer((host, port), make_handler(env, key))
    print(f"environment '{env.id}' serving at http://{host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


class RemoteEnvironment(Environment):
    """An environment served by `tidal env-server` at `address` (`http://host:port`)."""

    def __init__(self, address: str, timeout_s: float = 60.0, connect_timeout_s: float = 60.0) -> None:
        import os

        self.address = address.rstrip("/")
        key = os.environ.get(API_KEY_VAR)
        self.http = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {key}"} if key else {})
        info = self._wait_info(connect_timeout_s)
        self.id, self.max_turns, self.stop = str(info["id"]), int(info["max_turns"]), list(info["stop"])
        self.has_reward = bool(info.get("has_reward", True))

    def _wait_info(self, timeout_s: float) -> dict[str, Any]:
        start, last = time.monotonic(), ""
        while time.monotonic() - start < timeout_s:
            try:
                r = self.http.get(f"{self.address}/info")
                if r.status_code == 200:
                    return dict(r.json())
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.2)
        raise ValueError(f"environment server at {self.address} unreachable after {timeout_s:.0f} s ({last}); "
                         f"start it with `tidal env-server ID --port PORT` (env[].address)")

    def _post(self, route: str, body: dict[str, Any]) -> Any:
        """The route's JSON answer; ServiceUnavailable when the server cannot be reached, times out or answers a
        server error (5xx: the environment's side failed), RuntimeError for any other refusal."""
        where = f"environment '{self.id}' at {self.address}" if hasattr(self, "id") else self.address
        try:
            r = self.http.post(f"{self.address}{route}", json=body)
        except httpx.HTTPError as exc:  # refused, dropped, timed out
            raise ServiceUnavailable(where, f"POST {route}: {type(exc).__name__}: {exc}") from None
        if r.status_code >= 500:
            raise ServiceUnavailable(where, f"POST {route}: HTTP {r.status_code}: {r.text[:500]}")
        if r.status_code != 200:
            raise RuntimeError(f"environment server {self.address}{route}: {r.text[:500]}")
        return r.json()

    def unavailable(self) -> str | None:
        """Why the server does not answer `GET /info` now, or None."""
        try:
            r = self.http.get(f"{self.address}/info")
        except httpx.HTTPError as exc:
            return f"environment '{self.id}' at {self.address}: {type(exc).__name__}: {exc}"
        return None if r.status_code == 200 else f"environment '{self.id}' at {self.address}: HTTP {r.status_code}"

    def sample(self, rng: random.Random) -> Example:
        return example_from_json(self._post("/sample", {"seed": rng.getrandbits(63)}))

    def reward(self, example: Example, completion: str) -> float:
        body = {"example": example_to_json(example), "completion": completion}
        return float(self._post("/reward", body)["reward"])

    def respond(self, example: Example, transcript: str) -> str | None:
        reply = self._post("/respond", {"example": example_to_json(example), "transcript": transcript})["reply"]
        return None if reply is None else str(reply)

    def step_rewards(self, example: Example, completion: str) -> list[tuple[int, float]]:
        body = {"example": example_to_json(example), "completion": completion}
        steps = self._post("/step_rewards", body)["steps"]
        return [(int(a), float(b)) for a, b in steps]

    def eval_examples(self) -> list[Example] | None:
        ex = self._post("/eval_examples", {})["examples"]
        return None if ex is None else [example_from_json(e) for e in ex]


def spawn_server(env_id: str, args: dict[str, Any]) -> str:
    """Start `tidal env-server` for `env_id` as a child process (`tidal.procs.Child`) on a free localhost port;
    returns its address. The child (its whole group) is stopped when this process exits."""
    port = free_port()
    child = Child("env-server", [sys.executable, "-m", "tidal.cli", "env-server", env_id, "--args", json.dumps(args),
                                 "--port", str(port)])
    atexit.register(child.stop, 5.0)
    return f"http://127.0.0.1:{port}"
