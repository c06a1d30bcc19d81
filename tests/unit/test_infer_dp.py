"""Inference data parallel (infer `dp: N`): the per-server plan, the co-locate derivation (URLs, ports, core
split, GPU pairing), loading each policy into every server before sampling, and the supervisor of N servers
(real processes and signals, with a stand-in for vLLM)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from tests.unit.test_reaper import gone_within
from tidal.colocate.derive import Machine, derive_colocate
from tidal.config import ConfigError, InferConfig, OrchConfig, TrainConfig
from tidal.inference.backends.dp import PlacementError, core_groups, parse_cores, plan_servers

BIND = "VLLM_CPU_OMP_THREADS_BIND"


def infer(**kw: object) -> InferConfig:
    return InferConfig.model_validate({"model": "m", "port": 8000, **kw})


# --- the per-server plan (tidal grpo-infer) ---

def test_dp_1_is_one_server_with_vllms_own_placement():
    (only,) = plan_servers(infer(), ["0", "1"], (0, 1, 2, 3), {})
    assert (only.index, only.port, only.seed, dict(only.env)) == (0, 8000, 0, {})


def test_cpu_servers_get_consecutive_ports_own_seeds_and_equal_core_slices():
    plans = plan_servers(infer(dp=2, seed=5), None, (0, 1, 2, 3), {})
    assert [(p.port, p.seed, dict(p.env)) for p in plans] == [(8000, 5, {BIND: "0,1"}), (8001, 6, {BIND: "2,3"})]
    assert [p.env[BIND] for p in plan_servers(infer(dp=3), None, (0, 1, 2, 3, 4), {})] == ["0,1", "2,3", "4"]


def test_cpu_binding_from_the_environment_is_split_and_fewer_cores_are_shared():
    # tidal grpo on 2 cores gives vLLM core 0: both servers run there
    assert [p.env[BIND] for p in plan_servers(infer(dp=2), None, (0, 1), {BIND: "0"})] == ["0", "0"]
    assert [p.env[BIND] for p in plan_servers(infer(dp=2), None, (), {BIND: "4-7"})] == ["4,5", "6,7"]
    # tp ranks of one server are separated by '|', as vLLM expects
    assert [p.env[BIND] for p in plan_servers(infer(dp=2, tp=2), None, (0, 1, 2, 3), {})] == ["0|1", "2|3"]
    # a binding vLLM interprets itself is left to every server as it is
    assert all(not p.env for p in plan_servers(infer(dp=2), None, (0, 1), {BIND: "auto"}))


def test_gpu_servers_each_get_their_own_devices():
    plans = plan_servers(infer(dp=2), ["4", "5"], (0, 1), {"CUDA_VISIBLE_DEVICES": "4,5"})
    assert [dict(p.env) for p in plans] == [{"CUDA_VISIBLE_DEVICES": "4"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    plans = plan_servers(infer(dp=2, tp=2), ["0", "1", "2", "3"], (), {})
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["0,1", "2,3"]
    with pytest.raises(PlacementError, match=r"infer dp 2 x tp 2 needs 4 GPUs .* 3 are visible"):
        plan_servers(infer(dp=2, tp=2), ["0", "1", "2"], (), {})


def test_core_parsing_and_grouping():
    assert parse_cores("0-3,8") == [0, 1, 2, 3, 8] and parse_cores("5") == [5]
    assert parse_cores("auto") is None and parse_cores("0-1|2-3") is None and parse_cores("x") is None
    assert core_groups((0, 1, 2, 3, 4), 2) == [(0, 1, 2), (3, 4)]
    assert core_groups((7,), 3) == [(7,), (7,), (7,)]


def test_ports_must_fit():
    with pytest.raises(ValueError, match="port 65535 with dp 2"):
        infer(port=65535, dp=2)


# --- the co-locate derivation (tidal grpo) ---

def colocate(machine: Machine, train: dict | None = None, inf: dict | None = None, orch: dict | None = None):
    return derive_colocate(TrainConfig.model_validate({"model": "m", **(train or {})}), infer(**(inf or {})),
                           OrchConfig.model_validate(orch or {}), machine)


def test_colocate_dp_2_on_two_cores_lists_both_servers_and_shares_vllms_core():
    co = colocate(Machine(cores=(0, 1)), inf={"dp": 2}, orch={"max_async_level": 1})
    urls = ["http://127.0.0.1:8000/v1", "http://127.0.0.1:8001/v1"]
    assert co.orch.client.base_url == urls and co.infer.dp == 2
    p = co.placement
    assert list(p.base_urls) == urls and p.base_url == urls[0]
    assert p.health_urls == ("http://127.0.0.1:8000/health", "http://127.0.0.1:8001/health")
    assert (p.vllm_cores, p.trainer_cores, dict(p.infer_env)) == ((0,), (1,), {BIND: "0"})
    assert p.notices[-1] == "CPU only: vLLM on cores 0 (2 servers, sharing), trainer on cores [1]"
    # what tidal grpo-infer then makes of vLLM's share
    assert [s.env[BIND] for s in plan_servers(co.infer, None, (0, 1), p.infer_env)] == ["0", "0"]


def test_colocate_dp_2_on_policy_gives_each_server_one_of_all_cores_and_the_trainer_all():
    co = colocate(Machine(cores=(0, 1)), inf={"dp": 2})  # on-policy by default on CPU: the phases take turns
    p = co.placement
    assert (p.vllm_cores, p.trainer_cores, dict(p.infer_env)) == ((0, 1), (0, 1), {BIND: "0,1"})
    assert [s.env[BIND] for s in plan_servers(co.infer, None, (0, 1), p.infer_env)] == ["0", "1"]


def test_colocate_core_split_gives_each_vllm_rank_a_core_while_the_trainer_keeps_one():
    lag = {"max_async_level": 1}  # the phases overlap: the cores are split
    assert colocate(Machine(cores=tuple(range(8))), inf={"dp": 2}, orch=lag).placement.vllm_cores == (0, 1, 2, 3)
    co = colocate(Machine(cores=(0, 1, 2, 3)), inf={"dp": 3}, orch=lag)
    assert (co.placement.vllm_cores, co.train.cpu_affinity) == ((0, 1, 2), [3])
    assert colocate(Machine(cores=(0, 1, 2)), inf={"dp": 4}, orch=lag).placement.vllm_cores == (0, 1)
    assert colocate(Machine(cores=(0, 1, 2, 3)), inf={"dp": 1}, orch=lag).placement.vllm_cores == (0, 1)


def test_colocate_nccl_pushes_into_every_server():
    co = colocate(Machine(cores=(0, 1)), inf={"dp": 2, "host": "0.0.0.0", "port": 9000},
                  orch={"weight_broadcast": {"type": "nccl"}})
    urls = ["http://127.0.0.1:9000/v1", "http://127.0.0.1:9001/v1"]
    assert co.train.weight_broadcast.base_url == urls and co.orch.client.base_url == urls


def test_gpu_colocate_pairs_servers_with_trainer_ranks():
    gpu = Machine(cores=tuple(range(16)), has_gpu=True)
    co = colocate(gpu, train={"gpus": 2}, orch={"weight_broadcast": {"type": "nccl"}})
    assert co.infer.dp == 2 and len(co.orch.client.base_url) == 2 and len(co.placement.health_urls) == 2
    assert co.train.weight_broadcast.base_url == co.orch.client.base_url
    assert any("server i beside trainer rank i" in n for n in co.placement.notices)
    assert colocate(gpu, train={"gpus": 4}, inf={"tp": 2}).infer.dp == 2
    assert colocate(gpu, inf={"tp": 2}).infer.dp == 1  # one trainer rank beside a 2-GPU server: as before
    with pytest.raises(ConfigError, match=r"infer dp x tp \(3 x 1\) must equal train gpus \(2\)"):
        colocate(gpu, train={"gpus": 2}, inf={"dp": 3})
    # on CPU, trainer ranks and servers are not paired
    assert colocate(Machine(cores=(0, 1)), train={"gpus": 2}).infer.dp == 1


# --- every server serves the new policy before any request samples with it ---

class FakeServers:
    """httpx transport standing in for N vLLM servers; records (server, path) of every request in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        server, path = f"{request.url.host}:{request.url.port}", request.url.path
        self.log.append((server, path))
        if path == "/v1/completions":
            body = json.loads(request.content)
            return httpx.Response(200, json={"choices": [
                {"index": i, "text": "a", "token_ids": [5], "logprobs": {"token_logprobs": [-0.5]},
                 "finish_reason": "stop"} for i in range(body["n"])]})
        if path == "/metrics":
            return httpx.Response(200, text="process_start_time_seconds 1.0\n")
        return httpx.Response(200, json={})


def publish(run_dir: Path, step: int) -> None:
    from tidal.transport import weights

    def fill(d: Path) -> None:
        (d / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
        (d / "merged").mkdir()

    weights.publish(run_dir, step, fill)


@pytest.mark.parametrize("merged", [False, True])
def test_each_policy_is_loaded_into_every_server_before_sampling(tmp_path, merged):
    from tidal.config.orch import ClientSection
    from tidal.inference.backends.vllm.client import VllmClient
    from tidal.orchestrator.policy import PolicyTracker

    servers = ["127.0.0.1:8000", "127.0.0.1:8001"]
    fake = FakeServers()
    load = "/collective_rpc" if merged else "/v1/load_lora_adapter"

    async def go() -> None:
        client = VllmClient(ClientSection(base_url=[f"http://{s}/v1" for s in servers]))
        client.http = httpx.AsyncClient(transport=httpx.MockTransport(fake))
        tracker = PolicyTracker(client, "m", tmp_path, "default", merged=merged)
        try:
            for step in (1, 2):
                publish(tmp_path, step)
                await tracker.ensure(step, timeout_s=5)
                assert sorted(s for s, p in fake.log if p == load) == servers, f"policy {step} on both servers"
                fake.log.clear()
                for _ in range(4):
                    await client.sample(tracker.model, [1, 2], n=2, max_tokens=4, temperature=1.0)
                assert sorted(s for s, p in fake.log if p == "/v1/completions") == sorted(servers * 2)
                fake.log.clear()
        finally:
            await client.close()

    asyncio.run(go())


# --- the supervisor: N servers, one process tree, nothing left behind ---

# Stand-in for one vLLM server: starts an "engine" grandchild, prints both pids, then sleeps (or exits with
# code 3 after a moment when its port is the one named in TIDAL_TEST_EXIT_PORT).
FAKE_VLLM = textwrap.dedent("""
    import os, subprocess, sys, time
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print("pids", os.getpid(), engine.pid, flush=True)
    if sys.argv[1] == os.environ.get("TIDAL_TEST_EXIT_PORT"):
        time.sleep(1.5)
        sys.exit(3)
    time.sleep(120)
""")

SUPERVISOR = textwrap.dedent("""
    import os
    import sys
    from tidal.config.infer import InferConfig
    from tidal.inference.backends.dp import plan_servers, run_servers
    argv_of = lambda cfg: [sys.executable, "-c", sys.argv[1], str(cfg.port)]
    cfg = InferConfig(model="tidal:tiny-reverse", port=47000, dp=2)
    sys.exit(run_servers(cfg, plan_servers(cfg, None, (0, 1), {}), "127.0.0.1", argv_of, dict(os.environ)))
""")


def start_supervisor(exit_port: str = "") -> tuple[subprocess.Popen[str], list[int]]:
    """`run_servers` with two stand-in servers; returns it and the pids of both servers and both engines."""
    import os

    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR, FAKE_VLLM], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "TIDAL_TEST_EXIT_PORT": exit_port})
    assert proc.stdout is not None
    pids: list[int] = []
    prefixes = set()
    for line in proc.stdout:
        if " pids " in line:
            prefixes.add(line.split()[0])
            pids += [int(x) for x in line.split()[2:]]
        if len(pids) == 4:
            break
    assert prefixes == {"[dp0:47000]", "[dp1:47001]"}, "each server's lines carry its index and port"
    time.sleep(1.2)  # the reaper has scanned the family at least once
    return proc, pids


def test_sigkill_of_the_supervisor_leaves_no_server_or_engine():
    proc, pids = start_supervisor()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert gone_within(pids, 15), "servers or engines outlived a SIGKILLed grpo-infer"


def test_sigterm_stops_every_server():
    proc, pids = start_supervisor()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert gone_within(pids, 10)


def test_one_server_exiting_stops_the_others_and_fails():
    proc, pids = start_supervisor(exit_port="47001")
    out, _ = proc.communicate(timeout=40)
    assert proc.returncode == 3
    assert "vLLM server 1 (port 47001) exited with code 3; stopping the other 1" in out
    assert gone_within(pids, 10)
