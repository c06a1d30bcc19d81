"""Environments out of process: a spawned `tidal env-server` subprocess, one at `env[].address`, identical
results to the in-process environment, API-key rule beyond loopback."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from tests.conftest import free_port
from tidal.config.environments import EnvSection
from tidal.config.orch import OrchConfig
from tidal.envs import make_env
from tidal.envs.remote import RemoteEnvironment
from tidal.orchestrator.envmix import EnvMix, build_env


def test_spawned_environment_server_matches_the_in_process_one():
    remote = build_env(EnvSection(id="calculator", args={"max_operand": 30}, spawn=True))
    local = make_env("calculator", {"max_operand": 30})
    assert isinstance(remote, RemoteEnvironment)
    assert (remote.id, remote.max_turns, remote.stop) == ("calculator", 3, ["</calc>"])
    rng = random.Random(4)
    for _ in range(5):
        seed_rng = random.Random(rng.random())
        state = seed_rng.getstate()
        ex = remote.sample(seed_rng)
        seed_rng.setstate(state)
        assert ex == local.sample(random.Random(seed_rng.getrandbits(63)))
        turn = f"<calc>{ex.info['expression']}</calc>"
        assert remote.respond(ex, turn) == local.respond(ex, turn)
        answer = turn + f"<result>{ex.answer}</result> \\boxed{{{ex.answer}}}"
        assert remote.reward(ex, answer) == local.reward(ex, answer) == 1.0
    assert remote.eval_examples() is None


def test_environment_at_an_address_in_a_mix(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tidal.cli", "env-server", "reverse-text", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        cfg = OrchConfig.model_validate({"env": [{"id": "reverse-text", "name": "far",
                                                  "address": f"http://127.0.0.1:{port}"},
                                                 {"id": "reverse-text", "name": "near"}]})
        mix = EnvMix(cfg.env, cfg.buffer.env_ratios)
        tasks = [mix.sample(random.Random(i)).task for i in range(10)]
        assert tasks.count("far") == 5
        far = next(ex for ex in (mix.sample(random.Random(i)) for i in range(4)) if ex.task == "far")
        assert isinstance(mix.env_of(far), RemoteEnvironment)
        perfect = f"<reversed_text>{far.answer}</reversed_text>"
        assert mix.env_of(far).reward(far, perfect) == make_env("reverse-text").reward(far, perfect) == 1.0
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_env_server_refuses_open_bind_without_key_and_checks_the_key():
    env = {k: v for k, v in os.environ.items() if k != "TIDAL_ENV_API_KEY"}
    r = subprocess.run([sys.executable, "-m", "tidal.cli", "env-server", "reverse-text", "--host", "0.0.0.0",
                        "--port", str(free_port())], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "without an API key" in r.stderr
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tidal.cli", "env-server", "reverse-text", "--port", str(port)],
                            env={**env, "TIDAL_ENV_API_KEY": "s3cret"}, stdout=subprocess.DEVNULL)
    try:
        with pytest.raises(ValueError, match="unreachable.*HTTP 401"):
            RemoteEnvironment(f"http://127.0.0.1:{port}", connect_timeout_s=3)
        os.environ["TIDAL_ENV_API_KEY"] = "s3cret"
        try:
            assert RemoteEnvironment(f"http://127.0.0.1:{port}").id == "reverse-text"
        finally:
            del os.environ["TIDAL_ENV_API_KEY"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_address_and_spawn_are_exclusive():
    with pytest.raises(ValueError, match="address .* or spawn, not both"):
        EnvSection(id="reverse-text", address="http://127.0.0.1:1", spawn=True)
