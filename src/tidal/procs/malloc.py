"""The memory allocator of tidal's CPU processes: tcmalloc (gperftools' `libtcmalloc_minimal`) where it is installed.

Why: glibc's malloc hands every freed block above its mmap threshold back to the kernel, so each training step of a
CPU trainer faults its activations' pages in again (0.42 M minor faults a step on bench-learn's batch); tcmalloc
keeps them. Measured (bench/ALLOCATOR.md, fresh processes, the same batch and the same loss to the last bit): the
trainer's step 10.8 s against 14.1 s, its first step 12.3 s against 15.9 s. vLLM's CPU worker asks for it too (it
logs "libtcmalloc is not found in LD_PRELOAD" at every start without it).

An allocator is chosen when a process starts (`LD_PRELOAD`), so tidal puts it in the environment of the vLLM server
it execs (infer `malloc`, `tidal.inference.backends.vllm.server.vllm_env`) and a trainer process executes itself once
more with it before importing torch (train `malloc`, `reexec_with`): `tidal grpo`'s trainer, `tidal grpo-train`, the
warm pool's kept trainer. `auto` (the default) is tcmalloc on the CPU where it is found (`find_tcmalloc`: the
`TIDAL_TCMALLOC` file, the copy `make setup` unpacks into the virtual environment from Debian's
`libtcmalloc-minimal4`, the system's library directories), else glibc's malloc, said in one line; `tcmalloc` requires
it (exit 2 naming the key where it is not found); `system` keeps glibc's. On a GPU `auto` keeps glibc's (not
measured there).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

Malloc = Literal["auto", "tcmalloc", "system"]
LIBRARY = "libtcmalloc_minimal.so.4"
"""The file name: gperftools' tcmalloc without its heap profiler (Debian / Ubuntu `libtcmalloc-minimal4`), the one
vLLM's CPU documentation preloads."""
ENV_FILE = "TIDAL_TCMALLOC"
"""An environment variable naming the library file to use (searched first)."""
SYSTEM_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
REEXEC_MARK = "TIDAL_MALLOC_REEXEC"
"""Set in the environment of a process `reexec_with` started: it never executes itself a second time."""


def gpu_present(dev: Path = Path("/dev")) -> bool:
    """Whether this machine shows a GPU device node (NVIDIA's /dev/nvidiaN, AMD's /dev/kfd), read without importing
    torch (which a process about to execute itself again would import twice)."""
    return any(dev.glob("nvidia[0-9]*")) or (dev / "kfd").exists()


def trainer_on_cpu(device: str) -> bool:
    """Whether a trainer with train `device` runs on the CPU here: `cpu`, or `auto` on a machine without a GPU."""
    return device == "cpu" or (device == "auto" and not gpu_present())


def venv_dir() -> Path:
    """Where `make setup` unpacks the library (inside the virtual environment, removed with it)."""
    return Path(sys.prefix) / "lib" / "tidal-malloc"


def find_tcmalloc(environ: Mapping[str, str] | None = None, dirs: tuple[str, ...] | None = None) -> Path | None:
    """The tcmalloc library to preload: `TIDAL_TCMALLOC`'s file, else `make setup`'s copy, else the first of the
    system's library directories holding it; None where none does."""
    env = os.environ if environ is None else environ
    if env.get(ENV_FILE):
        path = Path(env[ENV_FILE])
        return path if path.is_file() else None
    for d in (str(venv_dir()), *(SYSTEM_DIRS if dirs is None else dirs)):
        path = Path(d) / LIBRARY
        if path.is_file():
            return path
    return None


def resolve(choice: Malloc, key: str, on_cpu: bool, environ: Mapping[str, str] | None = None,
            dirs: tuple[str, ...] | None = None) -> Path | None:
    """The library `choice` asks for here: tcmalloc's path, or None for glibc's malloc. `tcmalloc` where it is not
    found raises ValueError naming `key` (the caller's exit 2)."""
    if choice == "system" or (choice == "auto" and not on_cpu):
        return None
    found = find_tcmalloc(environ, dirs)
    if found is None and choice == "tcmalloc":
        raise ValueError(f"{key}: tcmalloc asked for, but no {LIBRARY} was found (${ENV_FILE}, {venv_dir()}, "
                         f"{', '.join(SYSTEM_DIRS if dirs is None else dirs)}): run `make setup` (Debian / Ubuntu), "
                         f"install gperftools' libtcmalloc-minimal4, or set {key}: auto / system")
    return found


def describe(lib: Path | None, choice: Malloc, on_cpu: bool) -> str:
    """The one line a process prints at its start about its allocator."""
    if lib is not None:
        return f"malloc: tcmalloc ({lib})"
    if choice == "system":
        return "malloc: glibc's (malloc: system)"
    if not on_cpu:
        return "malloc: glibc's (auto on a GPU)"
    return (f"malloc: glibc's: no {LIBRARY} found (`make setup` unpacks it on Debian / Ubuntu; the CPU trainer's step "
            f"is ~1.3x slower without it: bench/ALLOCATOR.md)")


def with_preload(env: Mapping[str, str], lib: Path | None) -> dict[str, str]:
    """`env` with `lib` first in LD_PRELOAD (kept once; the other entries kept in order); `env` as is for None."""
    out = dict(env)
    if lib is None:
        return out
    rest = [p for p in out.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p and p != str(lib)]
    out["LD_PRELOAD"] = ":".join([str(lib), *rest])
    return out


def loaded(lib: Path) -> bool:
    """Whether `lib` is mapped into this process (Linux: /proc/self/maps)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    real = str(lib.resolve())
    return any(line.endswith(real) or line.endswith(str(lib)) for line in maps.splitlines())


def reexec_with(lib: Path | None) -> None:
    """Execute this process's command again with `lib` preloaded when it is not loaded yet (never twice: a process
    this started that still lacks it raises RuntimeError, e.g. a loader that ignores LD_PRELOAD). Call it before
    anything else is started or imported that the second start would repeat."""
    if lib is None:
        return
    if loaded(lib):
        os.environ.pop(REEXEC_MARK, None)  # the processes this one starts decide for themselves
        return
    if os.environ.get(REEXEC_MARK):
        raise RuntimeError(f"{lib} was put in LD_PRELOAD but is not loaded in this process (LD_PRELOAD="
                           f"{os.environ.get('LD_PRELOAD', '')!r}): set malloc: system, or find out why the loader "
                           f"ignored it")
    env = with_preload(os.environ, lib) | {REEXEC_MARK: "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def for_trainer(choice: Malloc, device: str, may_exec: bool = True) -> str:
    """A trainer process's allocator: executes the process again with tcmalloc when train `malloc` resolves to it and
    it is not loaded yet (`reexec_with`); returns the line to log. ValueError (exit 2) as `resolve`. `may_exec`
    False: the command runs inside another program (`tidal.cli.main` called with its arguments, as the tests do),
    which must not be replaced: the allocator stays the process's own, and the line says so."""
    on_cpu = trainer_on_cpu(device)
    lib = resolve(choice, "train malloc", on_cpu)
    if lib is not None and not may_exec and not loaded(lib):
        return (f"malloc: the host process's own ({choice} would preload {lib}: this command runs inside another "
                f"program)")
    reexec_with(lib)
    return describe(lib, choice, on_cpu)
