"""The policy identity check against real vLLM on the bundled model (`tidal.orchestrator.identity`): the trainer
publishes each policy with its probe (`tidal.trainer.publish.probe`), the orchestrator's `PolicyTracker` loads it
the way `tidal grpo` does (LoRA adapter, merged reload, weight push) and checks what vLLM then serves.

Quiet when vLLM serves the published policy on each path; stops (`PolicyMismatch`, one line: step, path,
distances) on an adapter load that kept the previous weights, a merged copy published with the names the slim
reload used before issue 66 (an empty file: what Qwen2.5-VL / Llava / Gemma 3 published), and a push whose
tensors were dropped; `weight_broadcast.policy_check: false` turns the check and its metric off. One server (LoRA,
in-place reloads and the gloo weight-transfer engine), its base weights reset before each test.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import MODEL, free_port, kill_group, tidal, wait_healthy
from tidal.config.orch import ClientSection
from tidal.inference.backends.vllm.client import VllmClient
from tidal.models.sources import resolve_model
from tidal.orchestrator.identity import IdentityCheck
from tidal.orchestrator.policy import PolicyTracker
from tidal.trainer.model.load import load_base_model, load_tokenizer
from tidal.trainer.publish import push_vllm
from tidal.trainer.publish.broadcast import changed_keys, checkpoint_keys, publish_adapter
from tidal.trainer.publish.probe import Prober
from tidal.trainer.publish.push_vllm import WeightPusher
from tidal.transport.probe import PolicyMismatch

pytestmark = pytest.mark.vllm
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    port, log = free_port(), tmp_path_factory.mktemp("vllm_identity") / "infer.log"
    with open(log, "w") as f:
        proc = tidal("grpo-infer", "--infer.port", str(port), "--infer.weight_reload", "true",
                     "--infer.weight_broadcast_type", "nccl", stdout=f)
        try:
            wait_healthy(port, proc)
        except Exception:
            kill_group(proc)
            raise RuntimeError(log.read_text()[-3000:]) from None
        yield f"http://127.0.0.1:{port}/v1"
        kill_group(proc)


def lora_policy(seed: int) -> Any:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(load_base_model(MODEL, torch.device("cpu"), torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model.eval()


class Orchestrator:
    """The orchestrator's side: a `PolicyTracker` with the identity check, on a fresh client per call."""

    def __init__(self, url: str, run_dir: Path, mode: str, check: bool = True) -> None:
        self.url, self.run_dir, self.mode = url, run_dir, mode
        self.identity = IdentityCheck(enabled=check)
        self.client_class: type[VllmClient] = VllmClient
        self.tracker: PolicyTracker | None = None

    def ensure(self, step: int) -> dict[str, float]:
        async def go() -> dict[str, float]:
            client = self.client_class(ClientSection(base_url=[self.url]))
            try:
                base = (await client.wait_ready())[0]
                if self.tracker is None:
                    self.tracker = PolicyTracker(client, base, self.run_dir, "pol", merged=self.mode == "merged",
                                                 pushed_timeout_s=60 if self.mode == "push" else None,
                                                 identity=self.identity)
                self.tracker.client = client
                await self.tracker.ensure(step, 60)
                return self.identity.metrics()
            finally:
                await client.close()
        return asyncio.run(go())


def reset(url: str, tmp: Path) -> None:
    """Serve the base weights again (a merged reload or a push earlier in the module replaced them)."""
    async def go() -> None:
        client = VllmClient(ClientSection(base_url=[url]))
        try:
            await client.reload_weights(resolve_model(MODEL))
        finally:
            await client.close()
    asyncio.run(go())


def test_lora_loads_pass_and_an_adapter_load_that_kept_the_previous_weights_stops(server, tmp_path):
    reset(server, tmp_path)
    first, second = lora_policy(1), lora_policy(2)
    prober = Prober(first, load_tokenizer(MODEL))
    orch = Orchestrator(server, tmp_path, "lora")
    publish_adapter(first, tmp_path, 1, probe=prober.record(first, 1))
    m = orch.ensure(1)
    assert 0 <= m["policy/probe_gap"] < 1e-3 and m["policy/probe_time_s"] > 0

    class KeepsPrevious(VllmClient):  # an adapter load that did nothing: vLLM still serves policy 1's weights
        async def load_adapter(self, name: str, path: str) -> None:
            await super().load_adapter(name, str(tmp_path / "broadcasts" / "step_1"))

    publish_adapter(second, tmp_path, 2, probe=prober.record(second, 2))  # keep=None: step_1 stays
    orch.client_class = KeepsPrevious
    with pytest.raises(PolicyMismatch) as err:
        orch.ensure(2)
    line = str(err.value)
    assert "\n" not in line and "at step 2" in line and str(tmp_path / "broadcasts" / "step_2") in line
    assert "it serves the previous policy" in line and "from the base" in line


def test_the_check_off_lets_the_same_stale_load_through_and_logs_no_gap(server, tmp_path):
    reset(server, tmp_path)
    first, second = lora_policy(1), lora_policy(2)
    prober = Prober(first, load_tokenizer(MODEL))
    orch = Orchestrator(server, tmp_path, "lora", check=False)
    publish_adapter(first, tmp_path, 1, probe=prober.record(first, 1))
    assert orch.ensure(1) == {}

    class KeepsPrevious(VllmClient):
        async def load_adapter(self, name: str, path: str) -> None:
            await super().load_adapter(name, str(tmp_path / "broadcasts" / "step_1"))

    publish_adapter(second, tmp_path, 2, probe=prober.record(second, 2))
    orch.client_class = KeepsPrevious
    assert orch.ensure(2) == {}  # served stale, unchecked: what `policy_check: false` means


def test_merged_reloads_pass_and_the_pre_issue_66_empty_copy_stops(server, tmp_path):
    """LoRA policies published as slim merged copies (`changed_keys`) and a fully fine-tuned one pass; a copy
    published with the names the slim reload took before the fix (none, for a model transformers renames) leaves
    vLLM serving the previous policy, and the check stops there."""
    reset(server, tmp_path)
    keys = checkpoint_keys(resolve_model(MODEL))
    first, second = lora_policy(3), lora_policy(4)
    prober = Prober(first, load_tokenizer(MODEL))
    orch = Orchestrator(server, tmp_path, "merged")
    publish_adapter(first, tmp_path, 1, merged_keys=changed_keys(first, keys), probe=prober.record(first, 1))
    assert orch.ensure(1)["policy/probe_gap"] < 1e-3
    publish_adapter(second, tmp_path, 2, merged_keys=[], probe=prober.record(second, 2))  # the old, empty list
    with pytest.raises(PolicyMismatch, match=r"at step 2: .* it serves the previous policy"):
        orch.ensure(2)

    full = load_base_model(MODEL, torch.device("cpu"), torch.float32).eval()
    full_prober = Prober(full, load_tokenizer(MODEL))  # base: before its "training"
    with torch.no_grad():
        for p in full.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    orch2 = Orchestrator(server, tmp_path / "full", "merged")
    publish_adapter(full, tmp_path / "full", 1, merged_keys=keys, probe=full_prober.record(full, 1))
    assert orch2.ensure(1)["policy/probe_gap"] < 1e-3


def test_pushes_pass_and_a_push_whose_tensors_were_dropped_stops(server, tmp_path, monkeypatch):
    reset(server, tmp_path)
    first, second = lora_policy(5), lora_policy(6)
    prober = Prober(first, load_tokenizer(MODEL))
    orch = Orchestrator(server, tmp_path, "push")
    pusher = WeightPusher([server], "127.0.0.1", free_port(), timeout_s=120, api_key=None, device=torch.device("cpu"))
    try:
        pusher.push(first, 1)
        publish_adapter(first, tmp_path, 1, probe=prober.record(first, 1))
        assert orch.ensure(1)["policy/probe_gap"] < 1e-3
        # the push goes through and stamps version 2, but carries none of the policy's tensors
        monkeypatch.setattr(push_vllm, "policy_weight_specs", lambda model: [])
        monkeypatch.setattr(WeightPusher, "_tensors", staticmethod(lambda model, extra: iter([])))
        pusher.push(second, 2)
        publish_adapter(second, tmp_path, 2, probe=prober.record(second, 2))
        with pytest.raises(PolicyMismatch, match="at step 2: .* it serves the previous policy"):
            orch.ensure(2)
    finally:
        pusher.close()
