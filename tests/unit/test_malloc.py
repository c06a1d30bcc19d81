"""The allocator of tidal's CPU processes (`tidal.procs.malloc`): which library each `malloc` value resolves to, the
refusal of `tcmalloc` where none is found (naming the key), LD_PRELOAD kept in order, and the re-execution that
preloads a library into a process (a real exec, checked in /proc/self/maps of the process that runs on)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.config import InferConfig, TrainConfig
from tidal.procs import malloc


def fake_lib(tmp_path: Path) -> Path:
    d = tmp_path / "lib"
    d.mkdir()
    (d / malloc.LIBRARY).write_bytes(b"\x7fELF")
    return d


def test_each_choice_resolves_as_documented(tmp_path):
    found = fake_lib(tmp_path)
    dirs, none = (str(found),), (str(tmp_path / "empty"),)
    env: dict[str, str] = {}
    venv = malloc.venv_dir() / malloc.LIBRARY  # make setup's copy (where apt-get could fetch it) comes before `dirs`
    first = venv if venv.is_file() else found / malloc.LIBRARY
    assert malloc.resolve("auto", "k", True, env, dirs) == first
    assert malloc.resolve("auto", "k", False, env, dirs) is None  # a GPU keeps glibc's
    assert malloc.resolve("system", "k", True, env, dirs) is None
    assert malloc.resolve("tcmalloc", "k", False, env, dirs) == first
    if not venv.is_file():
        assert malloc.resolve("auto", "k", True, env, none) is None
        with pytest.raises(ValueError, match=r"train malloc: tcmalloc asked for, but no libtcmalloc_minimal\.so\.4"):
            malloc.resolve("tcmalloc", "train malloc", True, env, none)
    named = tmp_path / "mine.so"
    named.write_bytes(b"")
    assert malloc.resolve("auto", "k", True, {malloc.ENV_FILE: str(named)}, none) == named  # TIDAL_TCMALLOC first
    with pytest.raises(ValueError, match="k: tcmalloc asked for"):  # a named file that is not there is not found
        malloc.resolve("tcmalloc", "k", True, {malloc.ENV_FILE: str(tmp_path / "gone.so")}, dirs)


def test_the_preload_goes_first_once_and_keeps_the_rest(tmp_path):
    lib = tmp_path / "a.so"
    assert malloc.with_preload({"X": "1"}, None) == {"X": "1"}
    assert malloc.with_preload({}, lib)["LD_PRELOAD"] == str(lib)
    env = {"LD_PRELOAD": f"/x/gomp.so {lib}:/y/z.so", "X": "1"}
    assert malloc.with_preload(env, lib) == {"LD_PRELOAD": f"{lib}:/x/gomp.so:/y/z.so", "X": "1"}


def test_the_start_line_says_what_was_chosen_and_why(tmp_path):
    lib = tmp_path / "t.so"
    assert malloc.describe(lib, "auto", True) == f"malloc: tcmalloc ({lib})"
    assert "malloc: system" in malloc.describe(None, "system", True)
    assert "auto on a GPU" in malloc.describe(None, "auto", False)
    assert "no libtcmalloc_minimal.so.4 found" in malloc.describe(None, "auto", True)


def test_gpu_nodes_decide_auto_for_the_trainer(tmp_path):
    assert not malloc.gpu_present(tmp_path)
    (tmp_path / "nvidia0").touch()
    assert malloc.gpu_present(tmp_path)
    assert malloc.trainer_on_cpu("cpu") and not malloc.trainer_on_cpu("cuda:1")


def loadable() -> Path:
    """A shared library this venv has that a bare Python does not load and that does nothing when preloaded: torch's
    GNU OpenMP runtime (vLLM preloads the same file on CPU)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None
    torch_dir = Path(spec.origin).parent
    found = sorted([*torch_dir.joinpath("lib").glob("libgomp*.so*"), *torch_dir.parent.joinpath("torch.libs").glob(
        "libgomp*.so*")])
    assert found, f"no libgomp under {torch_dir}"
    return found[0]


def test_reexec_runs_the_same_command_again_with_the_library_loaded(tmp_path):
    """A process calls `reexec_with(lib)`: it executes itself again (same interpreter and arguments), and the process
    that carries on has `lib` mapped, LD_PRELOAD beginning with it, and no re-exec mark left for its own children;
    a second call there does nothing."""
    lib = loadable()
    script = tmp_path / "child.py"
    script.write_text(
        "import json, os, sys\n"
        "from pathlib import Path\n"
        "from tidal.procs import malloc\n"
        f"lib = Path({str(lib)!r})\n"
        "print('START', os.getpid(), flush=True)\n"
        "malloc.reexec_with(lib)\n"
        "malloc.reexec_with(lib)\n"
        "print('DONE ' + json.dumps({'pid': os.getpid(), 'loaded': malloc.loaded(lib), 'argv': sys.argv[1:],\n"
        "      'preload': os.environ.get('LD_PRELOAD', ''), 'mark': os.environ.get(malloc.REEXEC_MARK)}))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", malloc.REEXEC_MARK)}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(malloc.__file__).parents[2]), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, str(script), "--flag", "x y"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    starts = [line for line in out.stdout.splitlines() if line.startswith("START")]
    done = json.loads(out.stdout.split("DONE ", 1)[1])
    assert len(starts) == 2 and starts[0] == starts[1], out.stdout  # execve keeps the pid: the same process, twice
    assert done["loaded"] and done["argv"] == ["--flag", "x y"] and done["mark"] is None
    assert done["preload"].split(":")[0] == str(lib)


def test_both_configs_take_the_key_and_sglang_refuses_it():
    assert TrainConfig.model_fields["malloc"].default == "auto" and InferConfig.model_fields["malloc"].default == "auto"
    assert TrainConfig(model="m", malloc="system").malloc == "system"
    with pytest.raises(ValueError, match="malloc"):
        TrainConfig(model="m", malloc="jemalloc")
    with pytest.raises(ValueError, match="backend sglang: malloc preloads tcmalloc"):
        InferConfig(model="m", backend="sglang", malloc="tcmalloc")


def test_the_vllm_server_is_execd_with_the_allocator_its_key_asks_for(tmp_path, monkeypatch):
    """infer `malloc` reaches the environment tidal execs vLLM with (`vllm_env`): tcmalloc first in LD_PRELOAD,
    nothing added for `system`, and `tcmalloc` where none is found refused (ConfigError: exit 2) before vLLM starts."""
    from tidal.config.load import ConfigError
    from tidal.inference.backends.vllm import server

    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    monkeypatch.setattr(server, "on_cpu", lambda: True)
    monkeypatch.setenv(malloc.ENV_FILE, str(lib))
    monkeypatch.setenv("LD_PRELOAD", "/x/libother.so")
    env = server.vllm_env(InferConfig(model="m", malloc="tcmalloc"))
    assert env["LD_PRELOAD"] == f"{lib}:/x/libother.so"
    assert server.vllm_env(InferConfig(model="m"))["LD_PRELOAD"] == f"{lib}:/x/libother.so"  # auto, found
    assert server.vllm_env(InferConfig(model="m", malloc="system"))["LD_PRELOAD"] == "/x/libother.so"
    monkeypatch.setenv(malloc.ENV_FILE, str(tmp_path / "gone.so"))
    with pytest.raises(ConfigError, match="infer malloc: tcmalloc asked for"):
        server.vllm_env(InferConfig(model="m", malloc="tcmalloc"))


def test_grpo_train_refuses_tcmalloc_it_cannot_find_before_anything_starts(tmp_path):
    env = {**os.environ, malloc.ENV_FILE: str(tmp_path / "gone.so")}
    out = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo-train", "--train.malloc", "tcmalloc",
                          "--output-dir", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and "train malloc: tcmalloc asked for" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_a_command_run_inside_another_program_never_replaces_it(monkeypatch, tmp_path):
    """`tidal.cli.main([...])` inside a Python program (the tests do it): the trainer's allocator step must not
    execute the host program again; it says the allocator stays the host's."""
    import shutil

    lib = tmp_path / "libcopy.so"  # a file this process has certainly not loaded (torch may have loaded libgomp)
    shutil.copy(loadable(), lib)
    monkeypatch.setenv(malloc.ENV_FILE, str(lib))
    line = malloc.for_trainer("tcmalloc", "cpu", may_exec=False)
    assert "the host process's own" in line and str(lib) in line and not malloc.loaded(lib)
