"""Short real GRPO runs on the bundled model: co-locate, three processes, and failure handling.

Every run starts a real vLLM server. The runs are small (3 steps of 4 prompts x 4 rollouts) so they check
wiring, not learning; `tests/e2e/test_learning.py` (slow) checks learning on the default run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from tests.conftest import MODEL, free_port, kill_group, tidal, wait_healthy
from tidal.monitor.metrics import read_metrics
from tidal.transport.batch import TrainingBatch

pytestmark = pytest.mark.vllm

ORCH_SMALL = ["--orch.batch_size", "16", "--orch.rollouts_per_example", "4", "--orch.sampling.max_tokens", "24",
              "--orch.sampling.seed", "7"]
TRAIN_SMALL = ["--train.max_async_level", "8"]  # keep every broadcast, to compare step 1 with the last


def small(steps: int = 3) -> list[str]:
    return ["--orch.max_steps", str(steps), *ORCH_SMALL, *TRAIN_SMALL]
REQUIRED = ["step", "reward/mean", "reward/std", "seq_len/mean", "mismatch_kl", "masked", "loss", "grad_norm",
            "tokens", "step_time_s", "rollout_tokens_per_s", "trainer_tokens_per_s", "off_policy_level",
            "token_mult_prob_error", "entropy", "frac_reward_zero_std", "completions/mean_length", "policy/probe_gap",
            "timing/assemble_s", "timing/handoff_s", "timing/publish_s"]  # the step accounting (docs/orchestrator.md)


def check_metrics(run_dir: Path, steps: int) -> list[dict]:
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, f"step {r['step']} lacks {missing}"
        assert r["tokens"] > 0 and np.isfinite(r["loss"]) and r["grad_norm"] >= 0
        assert 0 <= r["policy/probe_gap"] <= 0.01, "the policy identity check passed: vLLM served each policy"
        assert 0 <= r["timing/handoff_s"] < 60 and 0 <= r["timing/assemble_s"] < r["step_time_s"] + 60
        assert "timing/handoff_at" not in r, "the trainer turns the orchestrator's stamp into timing/handoff_s"
    assert abs(rows[0]["mismatch_kl"]) <= 1e-3, "step 1 samples and trains the same policy"
    assert rows[0]["off_policy_level"] == 0 and rows[-1]["policy_step"] >= 1
    return rows


def adapter_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


def assert_adapter_changed(run_dir: Path, last: int) -> None:
    first, final = adapter_weights(run_dir / "broadcasts/step_1"), adapter_weights(run_dir / f"broadcasts/step_{last}")
    assert first.keys() == final.keys()
    assert any(not torch.equal(first[k], final[k]) for k in first), "training must change the adapter"


def assert_served_trained_policy(run_dir: Path, step: int) -> None:
    """Batch `step` was sampled by a trained policy and vLLM really applied it: the logprobs it reported match
    PEFT with that broadcast's adapter and differ from the base model."""
    from peft import PeftModel

    from tidal.models.sources import resolve_model
    from tidal.trainer.model.load import load_base_model
    from tidal.trainer.step.logprobs import forward_logprobs

    batch = TrainingBatch.load(run_dir / "rollouts" / f"step_{step}.safetensors")
    policy = int(batch.policy_steps[0])
    assert policy >= 1
    path = resolve_model(MODEL)
    base = load_base_model(path, torch.device("cpu"), torch.float32).eval()
    served = PeftModel.from_pretrained(load_base_model(path, torch.device("cpu"), torch.float32),
                                       str(run_dir / f"broadcasts/step_{policy}")).eval()
    gap_served = gap_base = 0.0
    for s in batch.samples()[:8]:
        ids = torch.from_numpy(batch.tokens[s]).long()[None]
        pos = torch.arange(ids.shape[1])[None]
        m = torch.from_numpy(batch.loss_mask[s]).bool()
        ref = torch.from_numpy(batch.inference_logprobs[s])[m]
        with torch.no_grad():
            gap_served = max(gap_served, float((forward_logprobs(served, ids, pos)[0][m] - ref).abs().max()))
            gap_base = max(gap_base, float((forward_logprobs(base, ids, pos)[0][m] - ref).abs().max()))
    assert gap_served < 1e-3, gap_served
    assert gap_base > gap_served * 10, (gap_base, gap_served)


class PlacementWatch(threading.Thread):
    """Samples the run's process tree every 0.3 s: each process's command line, CPU affinity and the OpenMP
    variables it was started with (what the trainer and vLLM really run on, not what the configs say)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.seen, self.done = pid, {}, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for p in descendants(self.pid):
                with contextlib.suppress(psutil.Error):
                    env = p.environ()
                    self.seen[p.pid] = (" ".join(p.cmdline()), tuple(sorted(p.cpu_affinity())),
                                        env.get("OMP_NUM_THREADS"), env.get("VLLM_CPU_OMP_THREADS_BIND"))
            self.done.wait(0.3)


def assert_phases_get_every_core(watch: PlacementWatch) -> None:
    """On-policy on CPU (tidal grpo's default there) vLLM and the trainer take turns: each must run on every core
    (a 1 + 1 split of 2 cores leaves one idle in each phase), issue 57."""
    cores = tuple(sorted(os.sched_getaffinity(0)))
    trainers = [v for v in watch.seen.values() if "grpo-train" in v[0]]
    vllm = [v for v in watch.seen.values() if v[3] is not None]  # the server and its engine core
    assert trainers and vllm, watch.seen
    assert all(t[1] == cores for t in trainers), (cores, trainers)
    bind = ",".join(map(str, cores))
    assert all(v[3] == bind and v[1] == cores for v in vllm), (cores, vllm)
    assert any(v[2] == str(len(cores)) for v in vllm), vllm  # vLLM's OpenMP threads: one per core


def test_colocate_run_trains_and_exits_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    port = free_port()
    proc = tidal("grpo", "--output-dir", str(run_dir), "--infer.port", str(port), *small(),
                 "--orch.eval", "{env: [{id: reverse-text, name: rev}], num_examples: 6, rollouts_per_example: 2, "
                 "interval: 1}")
    watch = PlacementWatch(proc.pid)
    watch.start()
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        watch.done.set()
        kill_group(proc)
    watch.join(timeout=10)
    assert proc.returncode == 0, out[-4000:]
    evals = read_metrics(run_dir / "eval.jsonl")
    assert [e["policy_step"] for e in evals][:1] == [0], "the base model is evaluated first"
    assert len(evals) >= 2 and evals[-1]["policy_step"] >= 1 and evals[-1]["eval/rev/examples"] == 6
    assert all(0 <= e["eval/rev/reward/mean"] <= 1 for e in evals)
    assert "run complete" in out and str(run_dir / "metrics.jsonl") in out
    # issue 37: on CPU the orchestrator and trainer start with vLLM; the launcher times the run's start-up
    assert "orchestrator and trainer started with it" in out and "[tidal] first step done after " in out
    check_metrics(run_dir, 3)
    assert_adapter_changed(run_dir, 3)
    assert (run_dir / "rollouts" / "DONE").read_text() == "3"
    assert (run_dir / "configs" / "orch.yaml").is_file()
    # on a CPU-only machine co-locate serves merged weights (vLLM's CPU LoRA path is slow): the LoRA factors, merged
    # inside vLLM's worker (issue 68), so the trainer writes the adapter and no merged copy
    assert "reload: factors" in (run_dir / "configs" / "orch.yaml").read_text()
    assert (run_dir / "broadcasts/step_3/adapter_model.safetensors").is_file()
    assert not (run_dir / "broadcasts/step_3/merged").exists()
    assert_served_trained_policy(run_dir, 3)
    assert (run_dir / "report.html").is_file() and (run_dir / "samples.jsonl").is_file()
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert all(r["off_policy_level"] == 0 for r in rows), "on a CPU machine tidal grpo is on-policy by default"
    assert "rollouts and training take turns" in out
    if len(os.sched_getaffinity(0)) >= 2:
        assert_phases_get_every_core(watch)


@pytest.mark.slow  # a whole run: make test-all (the default suite keeps the bundled run, ctrl-c, API)
def test_three_process_run_serves_the_trained_adapter(tmp_path):
    run_dir = tmp_path / "run"
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    infer = tidal("grpo-infer", "--infer.port", str(port))
    procs = [infer]
    try:
        # orchestrator and trainer start before the server is up: they must wait for it / for each other
        train = tidal("grpo-train", "--output-dir", str(run_dir), *TRAIN_SMALL)
        orch = tidal("grpo-orch", "--output-dir", str(run_dir), "--orch.client.base_url", f"[{url}]",
                     "--orch.max_steps", "3", *ORCH_SMALL, "--orch.env", "[{id: reverse-text, name: short}, "
                     "{id: 'tests.e2e.vf_reverse:build', name: long, args: {min_len: 20, max_len: 30}}]",
                     "--orch.buffer.env_ratios", "[3, 1]")
        procs += [train, orch]
        wait_healthy(port, infer)
        orch_out, _ = orch.communicate(timeout=600)
        train_out, _ = train.communicate(timeout=600)
        assert orch.returncode == 0, orch_out[-3000:]
        assert train.returncode == 0, train_out[-3000:]
        rows = check_metrics(run_dir, 3)
        # the second environment is a verifiers SingleTurnEnv (tests/e2e/vf_reverse.py), scored by its rubric
        assert all(r["reward/short/mean"] is not None and r["reward/long/mean"] is not None for r in rows)
        assert any(r["reward/long/mean"] > 0 for r in rows), "the verifiers rubric scored the completions"
        assert_adapter_changed(run_dir, 3)
        assert not (run_dir / "broadcasts/step_3/merged").exists(), "three processes default to LoRA reloads"
        assert_served_trained_policy(run_dir, 3)
        # `tidal grpo-infer` SIGKILLed alone (not its group): vLLM's engine processes must not outlive it
        engine = descendants(infer.pid)
        assert len(engine) >= 2, "vLLM's engine core runs in a child process (and the reaper beside it)"
        infer.send_signal(signal.SIGKILL)
        infer.wait(timeout=30)
        deadline = time.monotonic() + 20
        while alive(engine) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(engine), f"left running: {[p.cmdline() for p in alive(engine)]}"
    finally:
        for p in procs:
            kill_group(p)


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The processes of `procs` still running (zombies and those that exit while we look count as gone)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def wait_for_first_step(run_dir: Path, proc: subprocess.Popen, timeout: float = 400) -> None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        assert proc.poll() is None, proc.stdout.read()[-3000:] if proc.stdout else ""
        if (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip():
            return
        time.sleep(0.5)
    raise TimeoutError("no step completed")


@pytest.mark.parametrize("how", [pytest.param("kill-trainer", marks=pytest.mark.slow), "ctrl-c"])
def test_colocate_stops_everything_on_failure_or_interrupt(tmp_path, how):
    """(kill-trainer is slow-only: the default suite's resume run kills its trainer and checks the same.)"""
    run_dir = tmp_path / "run"
    port = free_port()
    # started with SIGINT ignored, as a background job of a non-interactive shell is: Ctrl-C must still work
    ignore_sigint = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if how == "ctrl-c" else None
    proc = tidal("grpo", "--output-dir", str(run_dir), "--infer.port", str(port), *small(50),
                 preexec_fn=ignore_sigint)
    try:
        wait_for_first_step(run_dir, proc)
        family = descendants(proc.pid)
        assert len(family) >= 3
        if how == "kill-trainer":
            trainer = [p for p in family if "grpo-train" in " ".join(p.cmdline())]
            assert len(trainer) == 1
            trainer[0].send_signal(signal.SIGKILL)
        else:
            os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    if how == "kill-trainer":
        assert proc.returncode == 1
        assert "the trainer exited" in out and "train.log" in out
    else:
        assert proc.returncode == 130 and "interrupted" in out
    time.sleep(1)
    left = alive(family)
    assert not left, f"orphans left: {[p.cmdline() for p in left]}"
    with pytest.raises(OSError):  # the server is gone
        __import__("socket").create_connection(("127.0.0.1", port), timeout=1)
