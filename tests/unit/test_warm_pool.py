"""The warm pool's checks without vLLM (`tidal.colocate.pool`): a run's derived server against the pool's state,
the attach lock, stale state files, `tidal serve`'s refusals. tests/e2e/test_warm_pool_run.py runs it for real."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import MODEL
from tidal.cli import main
from tidal.colocate import pool
from tidal.colocate.start import derive
from tidal.colocate.supervise import PoolServer
from tidal.config import ConfigError, InferConfig, OrchConfig, TrainConfig


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path))
    return tmp_path / "pool"


def colocated(**infer):
    return derive(TrainConfig(model=MODEL), InferConfig(model=MODEL, **infer), OrchConfig(), calibrate=False)


def state_for(co, pid: int | None = None) -> pool.PoolState:
    return pool.PoolState(pid=pid or os.getpid(), infer_pid=os.getpid(), model=co.infer.model,
                          infer=co.infer.model_dump(mode="json"), infer_env=dict(co.placement.infer_env),
                          health_urls=list(co.placement.health_urls), base_urls=list(co.placement.base_urls),
                          base_dir="/x", probe_ids=[3, 4], probe_base=[0.0, -1.0], dtype="float32", ready_s=1.0)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_the_same_files_derive_the_pools_server_and_any_other_key_is_named():
    co = colocated()
    state = state_for(co)
    assert pool.differences(state, co) == []
    pool.check_matches(state, co)
    other = colocated(max_model_len=8192)
    diff = pool.differences(state, other)
    assert diff == [f"infer max_model_len: pool {co.infer.max_model_len!r}, this run 8192"], diff
    with pytest.raises(ConfigError, match="other settings.*max_model_len: pool .*, this run 8192"):
        pool.check_matches(state, other)
    state.infer_env = {**state.infer_env, "VLLM_CPU_OMP_THREADS_BIND": "0-7"}
    assert any(d.startswith("vLLM environment VLLM_CPU_OMP_THREADS_BIND: pool '0-7'")
               for d in pool.differences(state, co))


def test_another_base_model_is_refused_naming_both(tmp_path):
    from tests.archs import build

    state = state_for(colocated())
    model = str(build("qwen3", tmp_path / "m"))
    co = derive(TrainConfig(model=model), InferConfig(model=model), OrchConfig(), calibrate=False)
    with pytest.raises(ConfigError) as exc:
        pool.check_matches(state, co)
    assert f"serves model {MODEL}, but this run trains {model}" in str(exc.value)
    assert "tidal serve --stop" in str(exc.value)


def test_what_a_pool_cannot_serve_is_refused():
    co = colocated()
    assert pool.refusal(co) is None
    nccl = co.infer.model_copy(update={"weight_broadcast_type": "nccl"})
    assert "nccl" in (pool.refusal(type(co)(**{**co.__dict__, "infer": nccl})) or "")
    shared = co.infer.model_copy(update={"export_base_weights": True})
    assert "share_base_weights" in (pool.refusal(type(co)(**{**co.__dict__, "infer": shared})) or "")


def test_state_of_a_dead_pool_is_stale_and_a_live_one_is_read(cache):
    co = colocated()
    cache.mkdir(parents=True)
    state_for(co, pid=dead_pid()).write(cache)
    assert pool.PoolState.read(cache) is None
    assert pool.attach(co) is None  # no pool runs: the run starts its own vLLM
    state_for(co).write(cache)
    assert pool.PoolState.read(cache) == state_for(co)


def test_one_run_at_a_time_holds_the_attach_lock(cache):
    cache.mkdir(parents=True)
    first = pool.take_lock(cache)
    with pytest.raises(ConfigError, match=f"another run \\(pid {os.getpid()}\\) is attached"):
        pool.take_lock(cache)
    first.close()  # released (as by a run's end, however it ends)
    pool.take_lock(cache).close()


def test_pool_server_is_watched_never_signalled(tmp_path):
    assert PoolServer(os.getpid(), tmp_path / "x.log").poll() is None
    assert PoolServer(dead_pid(), tmp_path / "x.log").poll() == 1
    PoolServer(os.getpid(), tmp_path / "x.log").signal_group(9)  # nothing happens to this process


def test_serve_commands(cache, capsys):
    assert main(["serve", "--status"]) == 1
    assert main(["serve", "--stop"]) == 0
    assert "no warm pool is running" in capsys.readouterr().out
    assert main(["serve", "--stop", "--model", MODEL]) == 2
    assert "takes no config files" in capsys.readouterr().err
    assert main(["serve", "--dry-run", "--infer.max_model_len", "1024"]) == 0
    assert "max_model_len: 1024" in capsys.readouterr().out
    co = colocated()
    cache.mkdir(parents=True)
    state_for(co).write(cache)
    with pytest.raises(ConfigError, match="a warm pool already runs"):
        pool.serve(co)


def test_a_dead_pool_server_ends_the_run_naming_the_pool(tmp_path):
    from tidal.colocate.supervise import ComponentFailed, InferRestarts

    (tmp_path / "x.log").write_text("vLLM said goodbye\n")
    watch = InferRestarts([], None, 0, PoolServer(dead_pid(), tmp_path / "x.log"))
    children: list = []
    with pytest.raises(ComponentFailed, match="warm pool's vLLM.*is gone") as exc:
        watch.check(children)
    assert exc.value.child.tail() == "vLLM said goodbye" and children == []
    InferRestarts([], None, 0, PoolServer(os.getpid(), tmp_path / "x.log")).check(children)  # alive: nothing
