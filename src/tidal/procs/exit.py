"""Ending a long-lived tidal process quickly once its work is done (`fast_exit`).

A process that imported torch, transformers and PEFT (with torchao and Triton under it) spends 1-2 s after its last
line in the interpreter's own teardown: every module's objects freed one by one, extension modules finalized
(measured on 2 cores: `import torch, transformers, peft` and nothing else takes 1.6 s from its last atexit handler
to its exit; torch alone 0.5 s). Nothing in that teardown is visible outside the process once its threads have
ended, its atexit handlers have run and its output is flushed, so `fast_exit` does exactly those, as the interpreter's
own shutdown would (`threading._shutdown`: the hooks of `concurrent.futures` and every non-daemon thread joined;
`atexit`: logging's flush, weakref finalizers, the SDKs' own hooks), and then leaves with `os._exit`. Files tidal
writes are closed where they are written (`with open(...)`, temp + rename), so no buffered write is left to the
teardown. Used by the `tidal` entry for the commands that run a trainer, an orchestrator or a whole run
(`tidal.cli.entry`); a test calling `tidal.cli.main` in process never gets here.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


def fast_exit(code: int) -> NoReturn:
    """Join the threads, run the atexit handlers, flush stdout and stderr, and end the process with `code` without
    the interpreter's module teardown (module doc)."""
    shutdown = getattr(threading, "_shutdown", None)  # CPython's own first step of finalization
    if shutdown is None:
        sys.exit(code)
    shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
