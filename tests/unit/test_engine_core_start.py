"""infer `engine_core_start` (issue 68): on CPU with tidal's in-engine worker, vLLM's engine core is forked from its
API server instead of spawned (`tidal.inference.backends.vllm.fork_core`), so it does not import torch and vLLM a
second time. Here: where `auto` forks and where `fork` exits 2; the environment the API server gets (one OpenMP
thread, the worker's count handed to the engine core); the patch itself in a real process with vLLM imported (the
context `CoreEngineProcManager` gets forks, the child has the parent's modules and the worker's thread count); and
why the API server must not have started an OpenMP pool (GNU libgomp: a child forked after a parallel region with
threads hangs at its own first one). The real server is tests/integration/test_engine_core_start.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tidal.config.infer import InferConfig
from tidal.config.load import ConfigError
from tidal.inference.backends.vllm import fork_core, server
from tidal.inference.backends.vllm.server import engine_core_fork, vllm_env

CFG = InferConfig(model="tidal:tiny-reverse", enable_lora=False)


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setattr(server, "on_cpu", lambda: True)
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_NUM_OF_RESERVED_CPU", "OMP_NUM_THREADS",
                fork_core.MODE_ENV, fork_core.THREADS_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3")  # a 4-core list: the worker's 4 threads
    return monkeypatch


def cfg(**kw) -> InferConfig:
    return CFG.model_copy(update=kw)


def test_auto_forks_a_single_cpu_server_and_the_api_server_gets_one_openmp_thread(cpu):
    for start in ("auto", "fork"):
        env = vllm_env(cfg(engine_core_start=start))
        assert env[fork_core.MODE_ENV] == "fork" and env[fork_core.THREADS_ENV] == "4"
        assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    env = vllm_env(cfg(engine_core_start="spawn"))  # vLLM-CPU's own start, as before issue 68
    assert fork_core.MODE_ENV not in env and fork_core.THREADS_ENV not in env and env["OMP_NUM_THREADS"] == "4"


def test_a_stale_mark_in_the_callers_environment_is_dropped(cpu):
    cpu.setenv(fork_core.MODE_ENV, "fork")
    assert fork_core.MODE_ENV not in vllm_env(cfg(engine_core_start="spawn"))


@pytest.mark.parametrize("update, env, why", [
    ({"tp": 2}, {}, "processes of its own"),
    ({"dp": 2}, {}, "processes of its own"),
    ({"extra_args": ["--distributed-executor-backend", "mp"]}, {}, "processes of its own"),
    ({}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, "processes of its own"),
    ({"extra_args": ["--numa-bind"]}, {}, "--numa-bind"),
])
def test_fork_where_it_cannot_hold_exits_2_and_auto_spawns(cpu, update, env, why):
    environ = {"VLLM_CPU_OMP_THREADS_BIND": "0-3", **env}
    with pytest.raises(ConfigError, match=f"infer engine_core_start: fork cannot hold for tidal:tiny-reverse: .*{why}"):
        engine_core_fork(cfg(engine_core_start="fork", **update), environ)
    assert engine_core_fork(cfg(engine_core_start="auto", **update), environ) is False
    assert fork_core.MODE_ENV not in vllm_env(cfg(**update), environ)


def test_fork_on_a_gpu_exits_2_and_auto_leaves_vllm_its_own_choice(monkeypatch):
    monkeypatch.setattr(server, "on_cpu", lambda: False)
    with pytest.raises(ConfigError, match="GPU"):
        engine_core_fork(cfg(engine_core_start="fork"), {})
    assert engine_core_fork(cfg(), {}) is False and fork_core.MODE_ENV not in vllm_env(cfg(), {})


def test_grpo_infer_refuses_fork_before_vllm_starts(tmp_path):
    """Through the CLI: exit 2 naming the key, before anything is started (tp 2 on CPU: vLLM's mp workers)."""
    r = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo-infer", "--infer.model", "tidal:tiny-reverse",
                        "--infer.tp", "2", "--infer.engine_core_start", "fork", "--infer.port", "8871"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "engine_core_start: fork cannot hold" in r.stdout + r.stderr


PATCHED = """
import os, sys
os.environ.update({"TIDAL_ENGINE_CORE_START": "fork", "TIDAL_ENGINE_OMP_THREADS": "2", "OMP_NUM_THREADS": "1"})
import torch
x = torch.randn(256, 256); (x @ x).sum()  # the API server's own torch work, at one thread
from tidal.inference.backends.vllm import plugin
plugin.register(); plugin.register()
import vllm.v1.engine.utils as engine_utils
assert plugin.installed()["fork_core"] and "TIDAL_ENGINE_CORE_START" not in os.environ
ctx = engine_utils.get_mp_context()
q = ctx.Queue()

def child(q):
    y = torch.randn(512, 512); (y @ y).sum()  # an OpenMP region with the worker's threads: no hang
    q.put((os.getppid(), torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS"), "vllm.config" in sys.modules))

p = ctx.Process(target=child, args=(q,))
p.start(); p.join(60)
assert p.exitcode == 0, p.exitcode
ppid, threads, omp, vllm_loaded = q.get(timeout=5)
print("RESULT", ppid == os.getpid(), threads, omp, vllm_loaded, torch.get_num_threads(),
      os.environ.get("OMP_NUM_THREADS"))
"""


def test_the_patch_forks_the_engine_core_with_the_workers_threads(tmp_path):
    """In a real process with vLLM imported: the context vLLM's engine-core launcher gets forks (the child's parent
    is this process and it has vLLM's modules without importing them), runs with the worker's 2 threads and
    OMP_NUM_THREADS=2, writes the line the integration test reads, and the API server keeps its one thread."""
    pytest.importorskip("vllm")
    r = subprocess.run([sys.executable, "-c", PATCHED], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "RESULT True 2 2 True 1 2" in r.stdout, r.stdout
    assert fork_core.FORKED_LINE in r.stderr and "2 OpenMP threads" in r.stderr


HANG = """
import multiprocessing as mp, os, sys, torch
torch.set_num_threads(int(sys.argv[1]))
x = torch.randn(512, 512)
for _ in range(3): (x @ x).sum()  # the parent's parallel region: with 2 threads, libgomp's pool now exists

def child():
    torch.set_num_threads(2)
    y = torch.randn(512, 512)
    for _ in range(3): (y @ y).sum()

p = mp.get_context("fork").Process(target=child); p.start(); p.join(8)
print("HUNG" if p.is_alive() else f"EXIT {p.exitcode}")
if p.is_alive(): p.kill()
"""


def test_why_the_api_server_runs_one_openmp_thread():
    """The hazard fork_core avoids, shown on this torch: a parent that ran a parallel region with 2 threads forks a
    child that hangs at its first one; at 1 thread in the parent, the child runs its 2 threads to the end."""
    one = subprocess.run([sys.executable, "-c", HANG, "1"], capture_output=True, text=True, timeout=60)
    assert one.stdout.strip() == "EXIT 0", one.stdout + one.stderr
    if (pytest.importorskip("torch").__config__.parallel_info().find("OpenMP") < 0):
        pytest.skip("torch without OpenMP here")
    two = subprocess.run([sys.executable, "-c", HANG, "2"], capture_output=True, text=True, timeout=60)
    assert two.stdout.strip() == "HUNG", two.stdout + two.stderr
