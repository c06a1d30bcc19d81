"""The OpenEnv server of a run: reached at `base_url`, or started here from an ASGI app's import path.

`serve_app("package.module:app", ...)` runs `python -m uvicorn package.module:app` on a free localhost port (the
app is what openenv-core's `create_app(Environment, Action, Observation)` returns, as an OpenEnv environment's
`server/app.py` defines it) with this process's interpreter, working directory and environment, as a
`tidal.procs.Child` (its own process group, SIGKILLed if this process dies), and stops its group when this process
exits (SIGTERM, then SIGKILL after 5 s; tidal's reaper covers the rest of a SIGKILLed orchestrator's family). The
tail of its output is quoted when it does not come up.

`ServerHandle` waits for `GET /health` and draws first observations with the stateless `POST /reset` route (a fresh
environment instance per call, closed after it; no WebSocket session is taken), both over plain HTTP (httpx).
"""

from __future__ import annotations

import atexit
import sys
from typing import Any

import httpx

from tidal.procs import Child, NotHealthy, free_port, wait_healthy

STOP_TIMEOUT_S = 5.0


class ServerError(Exception):
    """The OpenEnv server failed a request (unreachable, an error status, a timeout, a malformed answer)."""


class AppProcess:
    """`app` served by uvicorn in a child process (`tidal.procs.Child`) on 127.0.0.1."""

    def __init__(self, app: str) -> None:
        module, sep, attr = app.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"OpenEnv args.app '{app}' must be an import path 'package.module:app'")
        self.app, self.port = app, free_port()
        self.child = Child("openenv", [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port",
                                       str(self.port), "--log-level", "warning", "--no-access-log"])
        self.proc = self.child.proc
        atexit.register(self.stop)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def exited(self) -> str | None:
        """None while it runs; else its exit status and the tail of its output."""
        code = self.child.poll()
        if code is None:
            return None
        return f"exit status {code}; its output ends:\n{self.child.tail(40)[-2000:]}"

    def stop(self) -> None:
        self.child.stop(STOP_TIMEOUT_S)


class ServerHandle:
    """The run's OpenEnv server: started (`app`) or reached (`base_url`) by `start`, which waits for `/health`."""

    def __init__(self, base_url: str | None, app: str | None, timeout_s: float) -> None:
        self.given_url, self.app, self.timeout_s = base_url, app, timeout_s
        self.process: AppProcess | None = None
        self.http: httpx.Client | None = None

    @property
    def base_url(self) -> str:
        if self.process is not None:
            return self.process.base_url
        assert self.given_url is not None
        return self.given_url.rstrip("/")

    def start(self, startup_timeout_s: float) -> None:
        """Start the app (if any) and wait until `/health` answers 200; ValueError with the reason otherwise."""
        if self.http is not None:
            return
        if self.app is not None:
            self.process = AppProcess(self.app)
        try:
            wait_healthy(f"{self.base_url}/health", self.process.child if self.process else None, startup_timeout_s,
                         poll_s=0.2, get_timeout_s=self.timeout_s)
        except NotHealthy as exc:
            if self.process is not None and (why := self.process.exited()) is not None:
                raise ValueError(f"OpenEnv app '{self.app}' did not start ({why})") from None
            if self.process is not None:
                self.process.stop()
            where = f"app '{self.app}' at {self.base_url}" if self.app else f"server at {self.base_url}"
            raise ValueError(f"OpenEnv {where}: /health did not answer within {startup_timeout_s:g} s "
                             f"(args.startup_timeout_s; last: {exc.last})") from None
        self.http = httpx.Client(timeout=self.timeout_s)

    def reset(self, seed: int, reset_args: dict[str, Any]) -> dict[str, Any]:
        """`POST /reset` with `seed`: the first observation's payload `{observation, reward, done}`."""
        assert self.http is not None, "start() first"
        body = {**reset_args, "seed": seed}
        try:
            try:
                r = self.http.post(f"{self.base_url}/reset", json=body)
            except httpx.TransportError:  # once more, on a new connection: a kept-alive one may have been dropped
                r = self.http.post(f"{self.base_url}/reset", json=body)
        except httpx.HTTPError as exc:
            raise ServerError(f"POST /reset: {type(exc).__name__}: {exc}") from None
        if r.status_code != 200:
            raise ServerError(f"POST /reset: HTTP {r.status_code}: {r.text[:300]}")
        try:
            payload = r.json()
        except ValueError:
            raise ServerError(f"POST /reset: not JSON: {r.text[:300]}") from None
        if not isinstance(payload, dict) or not isinstance(payload.get("observation"), dict):
            raise ServerError(f"POST /reset: no observation object in {str(payload)[:300]}")
        return payload

    def stop(self) -> None:
        if self.http is not None:
            self.http.close()
            self.http = None
        if self.process is not None:
            self.process.stop()
            self.process = None
