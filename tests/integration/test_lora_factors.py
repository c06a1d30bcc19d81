"""Orch `weight_broadcast.reload: factors` against real vLLM (CPU): the worker merges a LoRA policy's factors into
its weights in place (`tidal.inference.backends.vllm.lora_merge`) and serves what the merged-copy path serves.

On tiny random-init Llama 3 (untied) and Qwen3 (tied embeddings), LoRA on all linear layers (q/k/v onto vLLM's
fused `qkv_proj`, gate/up onto `gate_up_proj`): the prompt logprobs after a worker merge equal those after a merged
reload of the same policy to float32 rounding, and agree with the trainer's; a second policy merged after the first
is served exactly (every merge starts from the worker's base copy); the same factors with the scale doubled, or
with two shards of one fused parameter swapped (k <-> v, gate <-> up), are served measurably differently, so these
checks fail on a wrong scale or shard offset. The orchestrator's `PolicyTracker` path runs the policy identity
check and stops on a merge that kept the previous policy. A 2-step `tidal grpo` with `reload: factors` ends with
float32-level mismatch KL and no merged copies written.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.archs import build
from tests.conftest import free_port, kill_group, tidal, wait_healthy
from tidal.config.orch import ClientSection
from tidal.inference.backends.vllm.client import VllmClient
from tidal.models.lora import resolve_lora_targets
from tidal.orchestrator.identity import IdentityCheck
from tidal.orchestrator.policy import PolicyTracker
from tidal.trainer.model.load import load_base_model, load_tokenizer
from tidal.trainer.publish.broadcast import changed_keys, checkpoint_keys, publish_adapter
from tidal.trainer.publish.probe import Prober
from tidal.trainer.step.logprobs import forward_logprobs
from tidal.transport.probe import PolicyMismatch

pytestmark = pytest.mark.vllm
IDS = [1, 5, 17, 33, 64, 9, 100, 42, 7, 88, 120, 3, 56, 77, 21, 99, 14, 60, 31, 2, 45, 110, 8, 70]
"""A fixed token sequence whose prompt logprobs the checks compare."""


@dataclass
class Served:
    name: str
    model_dir: Path
    url: str
    proc: Any


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def served(request, tmp_path_factory) -> Iterator[Served]:
    """vLLM without LoRA, able to reload in place (what `tidal grpo` starts for `reload: factors`)."""
    root = tmp_path_factory.mktemp(request.param)
    model_dir = build(request.param, root / "model")
    port, log = free_port(), root / "infer.log"
    with open(log, "w") as f:
        proc = tidal("grpo-infer", "--infer.model", str(model_dir), "--infer.port", str(port),
                     "--infer.enable_lora", "false", "--infer.weight_reload", "true", "--infer.max_model_len", "256",
                     stdout=f)
        try:
            wait_healthy(port, proc)
        except Exception:
            kill_group(proc)
            raise RuntimeError(log.read_text()[-3000:]) from None
        yield Served(request.param, model_dir, f"http://127.0.0.1:{port}/v1", proc)
        kill_group(proc)


def lora_policy(model_dir: Path, seed: int) -> Any:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = load_base_model(str(model_dir), torch.device("cpu"), torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=resolve_lora_targets(base,
                                                                                                    "all-linear")))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model.eval()


def call(s: Served, what: str, path: str | None = None) -> list[float]:
    """Run `what` (merge | reload | none) on the server, then return its prompt logprobs of `IDS`."""
    async def go() -> list[float]:
        client = VllmClient(ClientSection(base_url=[s.url], timeout=300))
        try:
            if what == "merge":
                await client.merge_lora(str(path))
            elif what == "reload":
                await client.reload_weights(str(path))
            return await client.prompt_logprobs(str(s.model_dir), IDS)
        finally:
            await client.close()
    return asyncio.run(go())


def gap(a: list[float], b: list[float]) -> float:
    return float((torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)).abs().max())


def trainer_logprobs(model: Any) -> list[float]:
    ids = torch.tensor([IDS])
    with torch.no_grad():
        return [0.0, *forward_logprobs(model, ids, torch.arange(len(IDS))[None], 1.0)[0, 1:].tolist()]


def publish(s: Served, model: Any, run: Path, step: int) -> Path:
    """Policy `step` as tidal publishes it for both paths: the adapter, and the merged adapted weights."""
    return publish_adapter(model, run, step, merged_keys=changed_keys(model, checkpoint_keys(s.model_dir)))


def variant(src: Path, dst: Path, alpha_times: float = 1.0, swap: tuple[str, str] | None = None) -> Path:
    """A copy of adapter `src` with alpha scaled, or the factors of two same-shaped projections swapped."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    config = json.loads((src / "adapter_config.json").read_text())
    config["lora_alpha"] *= alpha_times
    (dst / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(str(src / "adapter_model.safetensors"))
    if swap:
        a, b = swap
        tensors = {k.replace(f".{a}.", ".TMP.").replace(f".{b}.", f".{a}.").replace(".TMP.", f".{b}."): v
                   for k, v in tensors.items()}
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


def test_a_worker_merge_serves_what_the_merged_reload_serves(served, tmp_path):
    base = call(served, "none")
    first, second = lora_policy(served.model_dir, 1), lora_policy(served.model_dir, 2)
    p1, p2 = publish(served, first, tmp_path, 1), publish(served, second, tmp_path, 2)
    via_file = call(served, "reload", p1 / "merged")
    via_factors = call(served, "merge", p1)
    assert gap(base, via_file) > 1e-2, "policy 1 must differ from the base"
    assert gap(via_file, via_factors) <= 1e-5, f"{served.name}: merge vs merged reload {gap(via_file, via_factors)}"
    assert gap(via_factors, trainer_logprobs(first)) <= 1e-4
    # policy 2 after policy 1: merged onto the base copy, not onto policy 1
    assert gap(call(served, "merge", p2), call(served, "reload", p2 / "merged")) <= 1e-5
    # the checks above see a wrong scale or a wrong shard offset
    wrong = {"alpha x2": variant(p1, tmp_path / "alpha", alpha_times=2.0),
             "k <-> v": variant(p1, tmp_path / "kv", swap=("k_proj", "v_proj")),
             "gate <-> up": variant(p1, tmp_path / "gu", swap=("gate_proj", "up_proj"))}
    for what, path in wrong.items():
        assert gap(call(served, "merge", path), via_file) > 1e-3, f"{served.name}: {what} served like policy 1"
    assert gap(call(served, "merge", p1), via_file) <= 1e-5


def test_the_orchestrator_merges_checks_identity_and_stops_on_a_stale_merge(served, tmp_path):
    first, second = lora_policy(served.model_dir, 3), lora_policy(served.model_dir, 4)
    prober = Prober(first, load_tokenizer(str(served.model_dir)))
    publish_adapter(first, tmp_path, 1, probe=prober.record(first, 1))
    identity = IdentityCheck()
    assert not (tmp_path / "broadcasts" / "step_1" / "merged").exists()

    def ensure(step: int, client_class: type[VllmClient] = VllmClient) -> dict[str, float]:
        async def go() -> dict[str, float]:
            client = client_class(ClientSection(base_url=[served.url], timeout=300))
            try:
                tracker.client = client
                await tracker.ensure(step, 60)
                return identity.metrics()
            finally:
                await client.close()
        return asyncio.run(go())

    tracker = PolicyTracker(VllmClient(ClientSection(base_url=[served.url])), str(served.model_dir), tmp_path, "pol",
                            factors=True, identity=identity)
    assert tracker.merged  # the weights change in place: in-flight requests may see the new policy
    m = ensure(1)
    assert 0 <= m["policy/probe_gap"] < 1e-3 and m["policy/probe_time_s"] > 0

    class KeepsPrevious(VllmClient):  # a merge that served policy 1's factors again
        async def merge_lora(self, path: str) -> None:
            await super().merge_lora(str(tmp_path / "broadcasts" / "step_1"))

    publish_adapter(second, tmp_path, 2, probe=prober.record(second, 2))
    with pytest.raises(PolicyMismatch, match="at step 2: .* it serves the previous policy"):
        ensure(2, KeepsPrevious)


@pytest.mark.parametrize("name", ["qwen3", pytest.param("llama3", marks=pytest.mark.slow)])
def test_a_two_step_grpo_run_with_worker_merges_is_exact(name, tmp_path):
    from tidal.monitor.metrics import read_metrics

    model_dir = build(name, tmp_path / "model")
    run_dir = tmp_path / "run"
    proc = tidal("grpo", "--model", str(model_dir), "--output-dir", str(run_dir), "--infer.port", str(free_port()),
                 "--orch.max_steps", "2", "--orch.batch_size", "8", "--orch.rollouts_per_example", "4",
                 "--orch.sampling.max_tokens", "16", "--orch.weight_broadcast.reload", "factors")
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # step 2's rollouts come from policy 1, merged inside vLLM's worker
        assert r["mismatch_kl"] <= 1e-9, f"{name}: step {r['step']} mismatch KL {r['mismatch_kl']}"
    assert not list((run_dir / "broadcasts").glob("step_*/merged")), "reload: factors writes no merged copy"
    assert "identity check: probe gap" in (run_dir / "logs" / "orch.log").read_text()
    shutil.rmtree(model_dir)
