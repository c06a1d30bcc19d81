"""The warm pool's kept trainer without vLLM (`tidal.colocate.warm_trainer`, docs/warm-pool.md).

- A policy built on a kept base equals one built on a fresh load, bit for bit (LoRA init, logits), on several
  architectures; a kept base loaded for other train settings is refused naming the key, and is taken once only.
- In a forked child, a LoRA merge and a full fine-tune's optimizer step leave the kept base's fingerprint unchanged;
  the same writes without a fork change it (the check can fail).
- The real kept process: `tidal grpo-train --warm-trainer` relays a forked trainer's output and exit code; a relay
  killed outright takes its trainer with it, a SIGTERM is forwarded; the kept process keeps serving and records the
  base unchanged after every fork. The pool refuses a run its kept trainer cannot train (`trainer_differences`).
tests/e2e/test_warm_pool_run.py runs it with real vLLM and real runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.archs import build
from tests.conftest import MODEL
from tidal import procs
from tidal.cli import load as load_config
from tidal.colocate import pool, warm_trainer
from tidal.config import ConfigError, TrainConfig
from tidal.config.train import base_model_key
from tidal.paths import done_path
from tidal.procs.reaper import pid_alive
from tidal.trainer.model import load


@pytest.fixture(autouse=True)
def no_kept_base():
    yield
    load._kept = None


@pytest.mark.parametrize("arch", ["llama3", "qwen3", "qwen2.5"])
def test_a_policy_on_the_kept_base_equals_one_on_a_fresh_load(arch, tmp_path):
    cfg = TrainConfig(model=str(build(arch, tmp_path / arch)), device="cpu", seed=11)
    fresh, _ = load.load_policy(cfg)
    load.keep_base(load.load_base(cfg, torch.device("cpu")), base_model_key(cfg))
    kept, _ = load.load_policy(cfg)
    assert load._kept is None  # taken once
    a, b = fresh.state_dict(), kept.state_dict()
    assert a.keys() == b.keys() and any("lora_A" in k for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ids = torch.randint(3, 120, (2, 17), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, kept(ids).logits)


def test_a_kept_base_of_other_train_settings_is_refused_naming_the_key(tmp_path):
    cfg = TrainConfig(model=MODEL, device="cpu")
    load.keep_base(load.load_base(cfg, torch.device("cpu")), base_model_key(cfg))
    other = cfg.model_copy(update={"attention": "dense"})
    with pytest.raises(ConfigError, match="train attention: kept 'auto', this run 'dense'"):
        load.load_policy(other)


FORK_SCRIPT = """
import os, sys, torch
torch.set_num_threads(1)
from tidal.colocate.warm_trainer import fingerprint
from tidal.config import TrainConfig
from tidal.config.train import base_model_key
from tidal.trainer.model import load
cfg = TrainConfig(model=sys.argv[1], device="cpu", lora=sys.argv[2] == "lora", learning_rate=0.1)
base = load.load_base(cfg, torch.device("cpu"))
load.keep_base(base, base_model_key(cfg))
before = fingerprint(base)

def write_into_the_base():
    torch.set_num_threads(2)
    model, _ = load.load_policy(cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.arange(3, 40)[None]).logits.float().pow(2).mean().backward()
    opt.step()
    if cfg.lora:
        model.merge_and_unload()  # LoRA merged into the base weights, as a merged policy copy is made

if sys.argv[3] == "fork":
    pid = os.fork()
    if pid == 0:
        write_into_the_base()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
else:
    write_into_the_base()
print("SAME" if fingerprint(base) == before else "CHANGED")
"""


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_a_forked_trainer_cannot_write_into_the_kept_base(mode):
    def run(how: str) -> str:
        r = subprocess.run([sys.executable, "-c", FORK_SCRIPT, MODEL, mode, how], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout.strip().splitlines()[-1]

    assert run("fork") == "SAME"
    assert run("inplace") == "CHANGED"  # the same writes in the kept process itself: the fingerprint sees them


def test_threads_of_a_fork_follow_the_runs_environment():
    assert warm_trainer.threads_for({"OMP_NUM_THREADS": "3"}, 2) == 3
    assert warm_trainer.threads_for({}, 2) == 2
    assert warm_trainer.threads_for({"OMP_NUM_THREADS": "x"}, 2) == 2


def relay(tmp_path: Path, sock: Path, name: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tidal.cli", "grpo-train", "--warm-trainer", str(sock),
                             "--output-dir", str(tmp_path / name), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_line(proc: subprocess.Popen[str], needle: str, timeout: float = 120) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"{needle!r} not seen: {''.join(lines)[-3000:]}")


def forked_pid(lines: list[str]) -> int:
    line = next(x for x in lines if "forked from the warm pool" in x)
    return int(line.split("trainer pid ")[1].split()[0])


def wait_gone(pid: int, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not pid_alive(pid)


def test_the_kept_process_forks_trainers_relays_and_outlives_them(tmp_path):
    directory = tmp_path / "pool"
    directory.mkdir()
    cfg = load_config("train", None, {})  # the bundled example's, which the relays below load too
    (directory / "train.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    kept = procs.Child("trainer", [sys.executable, "-m", "tidal.colocate.warm_trainer", str(directory / "train.yaml"),
                                   str(directory)], log_path=directory / "trainer.log")
    try:
        state = pool.wait_kept_trainer(kept, directory, 180)
        sock = Path(state["socket"])
        done_path(tmp_path / "done").parent.mkdir(parents=True)
        done_path(tmp_path / "done").write_text("0")  # the orchestrator is done after 0 steps: build, then end
        r = relay(tmp_path, sock, "done")
        out = r.communicate(timeout=180)[0]
        assert r.returncode == 0, out[-3000:]
        assert "forked from the warm pool" in out and "kept loaded by the warm pool" in out, out[-3000:]
        assert "trainer ready on cpu" in out, out[-3000:]

        waiting = relay(tmp_path, sock, "killed")  # no batch comes: it waits until its relay is killed outright
        pid = forked_pid(wait_line(waiting, "trainer ready on cpu"))
        os.kill(waiting.pid, signal.SIGKILL)
        waiting.wait(timeout=10)
        assert wait_gone(pid), f"the forked trainer {pid} outlived its relay"

        termed = relay(tmp_path, sock, "termed")
        pid = forked_pid(wait_line(termed, "trainer ready on cpu"))
        termed.send_signal(signal.SIGTERM)
        assert termed.wait(timeout=30) == 128 + signal.SIGTERM
        assert wait_gone(pid)

        bad = relay(tmp_path, sock, "bad", "--train.attention", "dense")  # the pool's check missed it: refused
        out = bad.communicate(timeout=120)[0]
        assert bad.returncode == 2 and "train attention: kept 'auto', this run 'dense'" in out, out[-3000:]

        assert kept.poll() is None, kept.tail(30)
        deadline = time.monotonic() + 60
        while len(json.loads((directory / "trainer.json").read_text())["checks"]) < 4:
            assert time.monotonic() < deadline, (directory / "trainer.json").read_text()
            time.sleep(0.2)
        record = json.loads((directory / "trainer.json").read_text())
        assert record["forks"] == 4 and all(c["same"] and c["digest"] == record["digest"] for c in record["checks"])
    finally:
        procs.stop([kept])
    assert not pid_alive(kept.pid)


def test_the_pool_refuses_a_run_its_kept_trainer_cannot_train():
    from tidal.colocate.start import derive
    from tidal.config import InferConfig, OrchConfig

    def colocated(**train):
        return derive(TrainConfig(model=MODEL, **train), InferConfig(model=MODEL), OrchConfig(), calibrate=False)

    co = colocated()
    state = pool.PoolState(pid=os.getpid(), infer_pid=os.getpid(), model=MODEL, infer=co.infer.model_dump(mode="json"),
                           infer_env=dict(co.placement.infer_env), health_urls=[], base_urls=[], base_dir="/x",
                           probe_ids=[3], probe_base=[0.0], dtype="float32", ready_s=1.0,
                           trainer={"pid": 1, "socket": "/x", "key": base_model_key(co.train)},
                           code=pool.tidal_code())
    assert pool.trainer_differences(state, co) == []
    pool.check_matches(state, co)
    other = colocated(attention="dense")
    assert pool.trainer_differences(state, other) == ["train attention: pool 'auto', this run 'dense'"]
    with pytest.raises(ConfigError, match="keeps the trainer's base model loaded for other settings.*attention"):
        pool.check_matches(state, other)
    state.code = "/elsewhere/tidal"
    assert any(d.startswith("tidal code: the pool runs /elsewhere/tidal") for d in pool.trainer_differences(state, co))
    state.trainer = None  # a pool without a kept trainer: its runs load their own
    assert pool.trainer_differences(state, other) == []


def test_a_pool_keeps_no_trainer_when_told_or_where_it_cannot_fork(tmp_path, monkeypatch, capsys):
    from tidal.cli import main
    from tidal.colocate.start import derive
    from tidal.config import InferConfig, OrchConfig

    co = derive(TrainConfig(model=MODEL), InferConfig(model=MODEL), OrchConfig(), calibrate=False)
    child, why = pool.start_kept_trainer(co, tmp_path, keep=False)
    assert child is None and why is not None and "--no-trainer" in why
    gpu = dataclasses.replace(co, placement=dataclasses.replace(co.placement, device="cuda"))
    child, why = pool.start_kept_trainer(gpu, tmp_path)
    assert child is None and why is not None and "cannot fork" in why
    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path))
    assert main(["serve", "--stop", "--no-trainer"]) == 2
    assert "--no-trainer" in capsys.readouterr().err


def test_status_shows_the_kept_trainers_current_record(tmp_path, monkeypatch, capsys):
    from tidal.colocate.start import derive
    from tidal.config import InferConfig, OrchConfig

    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path))
    directory = pool.pool_dir()
    directory.mkdir(parents=True)
    co = derive(TrainConfig(model=MODEL), InferConfig(model=MODEL), OrchConfig(), calibrate=False)
    (directory / "trainer.json").write_text(json.dumps({"pid": 1, "forks": 3, "checks": [{"same": True}]}))
    pool.PoolState(pid=os.getpid(), infer_pid=os.getpid(), model=MODEL, infer=co.infer.model_dump(mode="json"),
                   infer_env={}, health_urls=[], base_urls=[], base_dir="/x", probe_ids=[3], probe_base=[0.0],
                   dtype="float32", ready_s=1.0, trainer={"pid": 1, "socket": str(directory / "trainer.sock")},
                   code=pool.tidal_code()).write(directory)
    assert pool.status() == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["trainer"]["forks"] == 3 and shown["trainer"]["checks"] == [{"same": True}]
