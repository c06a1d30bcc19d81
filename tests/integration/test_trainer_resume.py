"""Exact resume of the real trainer process (`tidal grpo-train`), SIGKILLed mid-run and restarted with
`--resume`: same final adapter bit for bit as an uninterrupted run, same LR schedule, no step twice, none
skipped, optimizer state restored. Then the final export: loadable by transformers, served by vLLM.

The batches are fixed files (random tokens, logprobs and advantages) so both runs see identical inputs.
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import MODEL, free_port, kill_group, tidal, wait_healthy
from tidal.config.orch import ClientSection, OrchConfig
from tidal.inference.backends.vllm.client import VllmClient
from tidal.inference.protocol import Completion
from tidal.monitor.metrics import read_metrics
from tidal.orchestrator.advantage import compute_advantages
from tidal.orchestrator.assemble import build_batch
from tidal.transport.filesystem import BatchWriter

STEPS = 6
TRAIN = ["--train.max_steps", str(STEPS), "--train.lr_scheduler_type", "cosine", "--train.warmup_steps", "2",
         "--train.sequence_len", "128", "--train.learning_rate", "5e-3"]


def write_batches(run_dir: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    cfg = OrchConfig.model_validate({"batch_size": 32, "rollouts_per_example": 4, "seq_len": 128})
    writer = BatchWriter(run_dir)
    for step in range(1, STEPS + 1):  # big enough that a step takes a while: the kills land mid-run
        prompts = [list(rng.integers(5, 120, size=rng.integers(4, 12))) for _ in range(8)]
        # inference logprobs near the bundled model's on random tokens (~ -5.9), so the trainer/inference
        # ratio stays inside the token and sequence masks and every step really updates the adapter
        groups = [[Completion(list(map(int, rng.integers(5, 120, size=n))), list(-rng.uniform(5.0, 6.5, size=n)),
                              "", "stop") for n in rng.integers(20, 60, size=4)] for _ in prompts]
        rewards = rng.uniform(0, 1, size=32)
        lens = np.array([len(c.token_ids) for g in groups for c in g])
        adv = compute_advantages(cfg.advantage, cfg.rollouts_per_example, rewards, lens, None, None)
        batch, metrics = build_batch(step, [list(map(int, p)) for p in prompts], groups, rewards, adv, 0, cfg)
        batch.metrics = metrics
        writer.write(batch)


def run_trainer(run_dir: Path, *extra: str) -> subprocess.Popen:
    return tidal("grpo-train", "--output-dir", str(run_dir), *TRAIN, *extra)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-3000:]
    return out


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("ref")
    write_batches(run_dir)
    finish(run_trainer(run_dir, "--train.export.merged", "true"))
    return run_dir


@pytest.mark.parametrize("interval", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_killed_trainer_resumes_exactly(tmp_path, reference, interval):
    write_batches(tmp_path)
    ckpt = ["--train.ckpt.interval", str(interval), "--train.ckpt.keep_last", "2"]
    kills = 0
    for kill_after in (2, 4):  # SIGKILL shortly after these steps complete (possibly mid-step)
        proc = run_trainer(tmp_path, *ckpt, *(["--resume"] if kills else []))
        deadline = time.monotonic() + 300
        while steps_done(tmp_path) < kill_after:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.05)
        time.sleep(random.uniform(0, 0.2))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert steps_done(tmp_path) < STEPS, "the trainer finished before it was killed: the test proves nothing"
        kills += 1
    out = finish(run_trainer(tmp_path, *ckpt, "--resume"))
    assert "resumed from checkpoint step" in out

    rows = read_metrics(tmp_path / "metrics.jsonl")
    ref_rows = read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "every step once, none skipped"
    assert [r["lr"] for r in rows] == [r["lr"] for r in ref_rows], "the LR schedule continues where it was"
    assert [r["optimizer_steps"] for r in rows] == list(range(1, STEPS + 1)), "optimizer state restored"
    assert rows[-1]["resumed_from"] >= 2
    for r, ref in zip(rows, ref_rows, strict=True):
        assert r["loss"] == ref["loss"] and r["grad_norm"] == ref["grad_norm"], r["step"]
    a = load_file(str(tmp_path / "final/adapter/adapter_model.safetensors"))
    b = load_file(str(reference / "final/adapter/adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "bit-identical final adapter"
    assert max(float(v.abs().max()) for k, v in a.items() if "lora_B" in k) > 0, "training changed the adapter"
    assert all(r["masked"] < 0.5 for r in rows), "most tokens are trained on"
    kept = sorted(p.name for p in (tmp_path / "checkpoints/trainer").iterdir())
    assert kept == [f"step_{STEPS - interval}", f"step_{STEPS}"], kept  # keep_last 2


@pytest.mark.slow  # two trainer runs: make test-all
def test_a_damaged_checkpoint_stops_the_trainer_with_the_file_named(tmp_path):
    write_batches(tmp_path)
    finish(run_trainer(tmp_path, "--train.ckpt.interval", "3", "--train.max_steps", "3"))
    (tmp_path / "checkpoints/trainer/step_3/trainer_state.safetensors").unlink()
    proc = run_trainer(tmp_path, "--resume")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert "checkpoints/trainer/step_3/trainer_state.safetensors is missing" in out


@pytest.mark.slow  # the reference run plus a vLLM load: make test-all
def test_final_export_loads_in_transformers_and_is_served_by_vllm(reference, vllm_server):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tidal.models.sources import resolve_model
    from tidal.trainer.model.load import load_base_model
    from tidal.trainer.step.logprobs import forward_logprobs

    merged_dir, adapter_dir = reference / "final/merged", reference / "final/adapter"
    assert (merged_dir / "STABLE").exists() and (adapter_dir / "STABLE").exists()
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(load_base_model(resolve_model(MODEL), torch.device("cpu"), torch.float32),
                                     str(adapter_dir)).eval()
    base = load_base_model(resolve_model(MODEL), torch.device("cpu"), torch.float32).eval()
    ids = torch.tensor([[3, 17, 42, 99, 7, 120, 31, 64, 12, 5]])
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        lp_merged = forward_logprobs(merged, ids, pos)[0]
        lp_peft = forward_logprobs(peft, ids, pos)[0]
        lp_base = forward_logprobs(base, ids, pos)[0]
    assert float((lp_merged - lp_peft).abs().max()) < 1e-4
    assert float((lp_merged - lp_base).abs().max()) > 1e-2, "the export holds the trained policy"

    async def served(url: str, model: str, load: tuple[str, str] | None = None) -> list[float]:
        client = VllmClient(ClientSection(base_url=[url]))
        try:
            await client.wait_ready()
            if load:
                await client.load_adapter(*load)
            return await client.prompt_logprobs(model, ids[0].tolist())
        finally:
            await client.close()

    lora = asyncio.run(served(vllm_server, "final-adapter", ("final-adapter", str(adapter_dir))))
    assert np.abs(np.array(lora[1:]) - lp_merged.numpy()[1:]).max() < 1e-3
    port = free_port()
    proc = tidal("grpo-infer", "--infer.model", str(merged_dir), "--infer.port", str(port),
                 "--infer.enable_lora", "false", "--infer.max_model_len", "256")
    try:
        wait_healthy(port, proc)
        plain = asyncio.run(served(f"http://127.0.0.1:{port}/v1", str(merged_dir)))
    finally:
        kill_group(proc)
    assert np.abs(np.array(plain[1:]) - lp_merged.numpy()[1:]).max() < 1e-3


def test_trainer_without_an_orchestrator_gives_up_with_a_clear_message(tmp_path):
    proc = run_trainer(tmp_path, "--train.batch_timeout_s", "3")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out[-2000:]
    assert "no batch 1 from the orchestrator" in out and "batch_timeout_s" in out and "--resume" in out
