"""Checkpoint files: state trees without pickle, atomic writes (also on a full disk), discovery, pruning,
corrupt files named in errors, metrics.jsonl rewinds, and the orchestrator's checkpoint round trip."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tidal.checkpoint import (
    CheckpointError,
    complete_steps,
    prune_checkpoints,
    resolve_resume_step,
    write_checkpoint,
)
from tidal.config.orch import OrchConfig
from tidal.monitor.metrics import MetricsWriter, read_metrics, truncate_metrics
from tidal.monitor.sinks import MetricsTail
from tidal.orchestrator.ckpt import Progress, resume_orch, save_orch
from tidal.paths import ckpt_dir
from tidal.trainer.state import from_tree, load_state, save_state, to_tree


def _model_and_opt(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
           xs: list[torch.Tensor]) -> None:
    for x in xs:
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
        sched.step()


def test_optimizer_and_scheduler_resume_exactly_through_safetensors_and_json(tmp_path):
    xs = [torch.randn(4, 5, dtype=torch.float64) for _ in range(6)]
    ref, ref_opt = _model_and_opt(0)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 0.9 ** s)
    _steps(ref, ref_opt, ref_sched, xs)

    a, a_opt = _model_and_opt(0)
    a_sched = torch.optim.lr_scheduler.LambdaLR(a_opt, lambda s: 0.9 ** s)
    _steps(a, a_opt, a_sched, xs[:3])
    save_state(tmp_path, "s", {"opt": a_opt.state_dict(), "sched": a_sched.state_dict(),
                               "model": a.state_dict(), "rng": random.getstate(), "step": 3})
    assert b"pickle" not in (tmp_path / "s.json").read_bytes()
    state = load_state(tmp_path, "s")
    b, b_opt = _model_and_opt(1)  # different init: everything must come from the checkpoint
    b_sched = torch.optim.lr_scheduler.LambdaLR(b_opt, lambda s: 0.9 ** s)
    b.load_state_dict(state["model"])
    b_opt.load_state_dict(state["opt"])
    b_sched.load_state_dict(state["sched"])
    assert state["rng"] == random.getstate().__class__(state["rng"]) and state["step"] == 3
    _steps(b, b_opt, b_sched, xs[3:])
    for p, q in zip(ref.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert b_sched.get_last_lr() == ref_sched.get_last_lr()
    assert int(b_opt.state[next(iter(b.parameters()))]["step"]) == 6


def test_tree_keeps_int_keys_tuples_and_refuses_arbitrary_objects():
    tensors: dict = {}
    obj = {"state": {0: {"m": torch.arange(3.0)}}, "betas": (0.9, 0.99), "names": ["a", None, 1.5]}
    back = from_tree(json.loads(json.dumps(to_tree(obj, tensors))), tensors)
    assert list(back["state"]) == [0] and back["betas"] == (0.9, 0.99) and back["names"] == ["a", None, 1.5]
    assert torch.equal(back["state"][0]["m"], torch.arange(3.0))
    with pytest.raises(TypeError, match="cannot checkpoint a object"):
        to_tree({"x": object()}, {})


def test_write_is_atomic_and_a_failed_write_leaves_nothing(tmp_path):
    write_checkpoint(tmp_path, "trainer", 1, lambda d: (d / "a.txt").write_text("one"))

    def boom(d: Path) -> None:
        (d / "a.txt").write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointError, match=r"step_2.*disk is full.*no partial checkpoint"):
        write_checkpoint(tmp_path, "trainer", 2, boom)
    root = tmp_path / "checkpoints" / "trainer"
    assert sorted(p.name for p in root.iterdir()) == ["step_1"]
    assert complete_steps(tmp_path, "trainer") == [1]
    (root / "step_3").mkdir()  # a directory without STABLE is not a checkpoint
    assert resolve_resume_step(tmp_path, "trainer", -1) == 1


def test_a_real_full_disk_gives_an_error_not_a_half_written_checkpoint(tmp_path):
    """RLIMIT_FSIZE makes writes past 64 KiB fail (EFBIG) like a full disk does, in a real subprocess."""
    script = textwrap.dedent(f"""
        import resource, signal, sys, torch
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        from pathlib import Path
        from tidal.checkpoint import CheckpointError, write_checkpoint
        from tidal.trainer.state import save_state
        run = Path({str(tmp_path)!r})
        write_checkpoint(run, "trainer", 1, lambda d: save_state(d, "s", {{"w": torch.zeros(100)}}))
        try:
            write_checkpoint(run, "trainer", 2, lambda d: save_state(d, "s", {{"w": torch.zeros(100_000)}}))
        except CheckpointError as exc:
            print("ERROR", exc)
            sys.exit(3)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "step_2" in r.stdout and "disk is full" in r.stdout
    assert complete_steps(tmp_path, "trainer") == [1]
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "trainer").iterdir()) == ["step_1"]


def test_resume_step_resolution_and_pruning(tmp_path):
    for s in range(1, 9):
        write_checkpoint(tmp_path, "orch", s, lambda d: None)
    assert resolve_resume_step(tmp_path, "orch", None) is None
    assert resolve_resume_step(tmp_path, "orch", -1) == 8
    assert resolve_resume_step(tmp_path, "orch", 5) == 5
    with pytest.raises(CheckpointError, match="resume_step 12.*complete steps: 1, 2"):
        resolve_resume_step(tmp_path, "orch", 12)
    assert prune_checkpoints(tmp_path, "orch", None, None) == []
    prune_checkpoints(tmp_path, "orch", keep_last=2, keep_interval=3)
    assert complete_steps(tmp_path, "orch") == [3, 6, 7, 8]
    assert resolve_resume_step(tmp_path / "nothing", "orch", -1) is None


def test_corrupt_checkpoint_files_are_named(tmp_path):
    save_state(tmp_path, "s", {"w": torch.ones(3)})
    (tmp_path / "s.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match=r"s\.safetensors is corrupt"):
        load_state(tmp_path, "s")
    save_state(tmp_path, "s", {"w": torch.ones(3)})
    (tmp_path / "s.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"s\.json is corrupt"):
        load_state(tmp_path, "s")
    (tmp_path / "s.json").unlink()
    with pytest.raises(CheckpointError, match=r"s\.json is missing"):
        load_state(tmp_path, "s")


def test_truncate_metrics_drops_later_steps_and_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    w = MetricsWriter(path)
    for s in range(1, 6):
        w.write({"step": s, "loss": s / 10})
    with open(path, "a") as f:
        f.write('{"step": 6, "lo')  # killed mid-write
    assert truncate_metrics(path, 3) == 3
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert truncate_metrics(path, 3) == 0
    assert not list(tmp_path.glob(".*tmp*"))


def test_metrics_tail_survives_a_rewrite_by_a_resuming_trainer(tmp_path):
    path = tmp_path / "metrics.jsonl"
    w = MetricsWriter(path)
    tail = MetricsTail(path)
    for s in (1, 2, 3):
        w.write({"step": s})
    assert [r["step"] for r in tail.poll()] == [1, 2, 3]
    truncate_metrics(path, 2)  # trainer resumed from step 2: file replaced
    assert tail.poll() == [] and tail.last_step == 2
    w.write({"step": 3, "again": True})
    assert [(r["step"], r.get("again")) for r in tail.poll()] == [(3, True)]


def test_orchestrator_checkpoint_restores_sampler_and_progress(tmp_path):
    cfg = OrchConfig.model_validate({"ckpt": {"interval": 1}})
    rng = random.Random(5)
    rng.random()
    save_orch(tmp_path, Progress(step=4, total_tokens=900, total_samples=64), rng, cfg.ckpt)
    expected = [rng.random() for _ in range(3)]
    (tmp_path / "rollouts").mkdir()
    for s in (4, 5, 6):
        (tmp_path / "rollouts" / f"step_{s}.safetensors").write_text("x")
    (tmp_path / "rollouts" / "DONE").write_text("6")
    MetricsWriter(tmp_path / "samples.jsonl").write({"step": 5})

    resumed = random.Random(99)
    cfg.ckpt.resume_step = -1
    progress = resume_orch(tmp_path, cfg.ckpt, resumed)
    assert (progress.step, progress.total_tokens, progress.total_samples) == (4, 900, 64)
    assert [resumed.random() for _ in range(3)] == expected
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["step_4.safetensors"]
    assert read_metrics(tmp_path / "samples.jsonl") == []

    fresh = random.Random(99)
    cfg.ckpt.skip_buffer = cfg.ckpt.skip_progress = True
    progress = resume_orch(tmp_path, cfg.ckpt, fresh)
    assert (progress.step, progress.total_tokens) == (4, 0)
    assert fresh.random() == random.Random(99).random()

    (ckpt_dir(tmp_path, "orch", 4) / "state.json").write_text("[1, 2")
    with pytest.raises(CheckpointError, match=r"orch/step_4/state\.json is corrupt"):
        resume_orch(tmp_path, cfg.ckpt, fresh)


def test_resume_without_checkpoints_refuses_when_batches_exist(tmp_path):
    cfg = OrchConfig.model_validate({"ckpt": {"resume_step": -1}})
    assert resume_orch(tmp_path, cfg.ckpt, random.Random(0)).step == 0  # nothing there: a fresh start
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "step_1.safetensors").write_text("x")
    with pytest.raises(CheckpointError, match="no orchestrator checkpoint.*ckpt.interval"):
        resume_orch(tmp_path, cfg.ckpt, random.Random(0))
