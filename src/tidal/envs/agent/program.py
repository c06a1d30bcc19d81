"""Running the user's agent program once per session: a command (a child process) or an import-path callable.

A command runs through `tidal.procs.run`: its own session and process group, SIGKILL when the orchestrator dies
(the parent-death signal), its whole group killed past `timeout_s`. It gets the session's URLs and key in the
variables the OpenAI and Anthropic SDKs read, the model name, the reward URL and the example as JSON. A callable
`fn(base_url, api_key, example)` runs in a worker thread (sync; `POOL`) or on the orchestrator's loop (async),
bounded by `timeout_s` (a sync function past it is abandoned: Python cannot kill a thread; its session is closed,
so its next call is answered 404). The outcome is `(failure or None, reward or None)`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import shlex
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tidal.envs.tools import load_object
from tidal.procs import run

TAIL = 1500
"""Characters of a failed command's stderr kept in its failure."""
POOL = ThreadPoolExecutor(max_workers=256, thread_name_prefix="tidal-agent")
"""The threads programs run in (a command's waiting thread, a sync callable): one per session at once, so the
orchestrator's default executor (a few threads on a small machine) does not queue sessions behind each other."""


async def in_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(POOL, fn, *args)


def environment(openai_url: str, anthropic_url: str, key: str, model: str, example: dict[str, Any]
                ) -> dict[str, str]:
    """The variables a command gets (module doc)."""
    return {"OPENAI_BASE_URL": openai_url, "OPENAI_API_KEY": key, "ANTHROPIC_BASE_URL": anthropic_url,
            "ANTHROPIC_API_KEY": key, "TIDAL_AGENT_MODEL": model, "TIDAL_AGENT_REWARD_URL": f"{anthropic_url}/reward",
            "TIDAL_AGENT_EXAMPLE": json.dumps(example)}


class Program:
    """The configured program (`AgentArgs.command` or `AgentArgs.function`)."""

    def __init__(self, command: list[str] | str | None, function: str | None, timeout_s: float) -> None:
        self.argv = shlex.split(command) if isinstance(command, str) else command
        if self.argv is not None and shutil.which(self.argv[0]) is None:
            raise ValueError(f"agent args.command: '{self.argv[0]}' is not an executable file nor found on PATH "
                             f"(command {self.argv})")
        self.fn = load_object(function, "agent args.function") if function is not None else None
        if self.fn is not None and not callable(self.fn):
            raise ValueError(f"agent args.function '{function}' is not callable")
        self.timeout_s = timeout_s

    async def run(self, env: dict[str, str], example: dict[str, Any]) -> tuple[str | None, float | None]:
        """Run once with `env` (module doc); (why it failed or None, the reward it returned or None)."""
        if self.argv is not None:
            return await self._command(env)
        return await self._callable(env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"], example)

    async def _command(self, env: dict[str, str]) -> tuple[str | None, float | None]:
        try:
            done = await in_thread(run, self.argv or [], self.timeout_s, env)
        except subprocess.TimeoutExpired:
            return f"the program ran past timeout_s={self.timeout_s:g} s and was killed", None
        except OSError as exc:
            return f"the program {self.argv} could not start: {exc}", None
        if done.returncode != 0:
            return (f"the program exited with code {done.returncode}: "
                    f"{(done.stderr or done.stdout or '').strip()[-TAIL:]}"), None
        return None, None

    async def _callable(self, base_url: str, key: str, example: dict[str, Any]) -> tuple[str | None, float | None]:
        assert self.fn is not None
        try:
            if inspect.iscoroutinefunction(self.fn):
                value = await asyncio.wait_for(self.fn(base_url, key, example), self.timeout_s)
            else:
                value = await asyncio.wait_for(in_thread(self.fn, base_url, key, example), self.timeout_s)
        except TimeoutError:
            return f"the program ran past timeout_s={self.timeout_s:g} s", None
        except Exception as exc:  # noqa: BLE001 - the program's failure fails its episode, never the run
            return f"the program raised {type(exc).__name__}: {exc}", None
        if value is None:
            return None, None
        if not isinstance(value, int | float) or isinstance(value, bool):
            return f"the program returned a {type(value).__name__}; return a number (its reward) or None", None
        return None, float(value)




def import_path_of(fn: Any) -> str:
    """An import path (`AgentArgs.function`) of a callable of this process: its own when importing it gives it back,
    else a name in this module (`tidal.envs.agent.program:local_<id>`), valid in this process only, which holds it
    (the Python API, `GRPOTrainer(agent=fn)`: its orchestrator runs in the script's process, so closures, lambdas and
    `__main__` functions are called where they live; nothing is pickled)."""
    import importlib

    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module and module != "__main__" and name.isidentifier():
        try:
            if getattr(importlib.import_module(module), name) is fn:
                return f"{module}:{name}"
        except (ImportError, AttributeError):
            pass
    local = f"local_{id(fn):x}"
    globals()[local] = fn
    return f"{__name__}:{local}"
