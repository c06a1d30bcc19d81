"""The architecture matrix against real vLLM (CPU): every architecture of `tests.archs`, random-init and tiny.

One vLLM server per architecture (a module-scoped fixture per parameter) serves all of its checks: vLLM's
sampled tokens get the trainer's logprobs (mismatch KL <= 1e-3 in fp32); a LoRA adapter on `all-linear`
loads into vLLM and is served exactly (not for MoE on CPU: refused up front, `tidal.models.arch`); merged
weights (a LoRA policy and a fully fine-tuned one) reloaded in place, and pushed over gloo, are served exactly,
which checks the checkpoint <-> vLLM names (fused qkv / gate_up, MoE experts, tied embeddings). A 2-step
`tidal grpo` run completes on each (its step-1 mismatch KL <= 1e-3). Architectures with `default_suite` run
in the default suite (Qwen3-MoE and Phi-3: experts, fused qkv / gate_up names; Qwen3.5's are `slow`, its
grpo run default, to keep the default suite near 20 minutes); the
grpo runs of `GRPO_RUN_DEFAULT` (Qwen3, Qwen3.5, Gemma 3, Gemma 4) are too; the rest are `slow`. docs/models.md is
this matrix (`tests/unit/test_models.py`).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.archs import ARCHS, GRPO_RUN_DEFAULT, build
from tests.conftest import free_port, kill_group, tidal, wait_healthy
from tidal.config.orch import ClientSection
from tidal.inference.backends.vllm.client import VllmClient
from tidal.models.lora import excluded_modules, resolve_lora_targets
from tidal.models.names import is_expert_key
from tidal.trainer.model.load import load_base_model
from tidal.trainer.publish.broadcast import checkpoint_keys, merged_state_dict, reload_keys
from tidal.trainer.publish.push_vllm import WeightPusher
from tidal.trainer.step.logprobs import forward_logprobs

pytestmark = pytest.mark.vllm

PARAMS = [pytest.param(name, marks=() if arch.default_suite else pytest.mark.slow, id=name)
          for name, arch in ARCHS.items() if not arch.cpu_refused]  # refused up front: tests/unit/test_cpu_served.py
MESSAGES = [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": "hello world"}]


@dataclass
class Served:
    name: str
    model_dir: Path
    url: str
    proc: Any
    log: Path


@pytest.fixture(scope="module", params=PARAMS)
def served(request, tmp_path_factory) -> Iterator[Served]:
    """vLLM on a tiny random model of one architecture: LoRA enabled (unless MoE), in-place weight reloads and
    the gloo weight-transfer engine."""
    name = request.param
    root = tmp_path_factory.mktemp(name)
    model_dir = build(name, root / "model")
    port, log = free_port(), root / "infer.log"
    with open(log, "w") as f:
        proc = tidal("grpo-infer", "--infer.model", str(model_dir), "--infer.port", str(port),
                     "--infer.enable_lora", str(ARCHS[name].vllm_lora).lower(), "--infer.weight_reload", "true",
                     "--infer.weight_broadcast_type", "nccl", "--infer.max_model_len", "256", stdout=f)
        try:
            wait_healthy(port, proc)
        except Exception:
            kill_group(proc)
            raise RuntimeError(log.read_text()[-3000:]) from None
        yield Served(name, model_dir, f"http://127.0.0.1:{port}/v1", proc, log)
        kill_group(proc)


def sample(s: Served, model: str | None = None) -> tuple[list[int], list[Any]]:
    async def go():
        client = VllmClient(ClientSection(base_url=[s.url]))
        try:
            prompt = await client.tokenize_chat(str(s.model_dir), MESSAGES)
            return prompt, await client.sample(model or str(s.model_dir), prompt, 8, 32, 1.0, seed=11)
        finally:
            await client.close()
    return asyncio.run(go())


def agreement(model: torch.nn.Module, s: Served, served_name: str | None = None) -> tuple[float, float]:
    """(largest |trainer - vLLM| logprob gap, mismatch KL: mean k3 estimate of KL(vLLM || trainer) per token)
    over vLLM's samples of the chat prompt."""
    prompt, comps = sample(s, served_name)
    gaps, kls = [], []
    for c in comps:
        ids = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            ours = forward_logprobs(model.eval(), ids, torch.arange(ids.shape[1])[None], 1.0)[0, len(prompt):]
        d = ours.double() - torch.tensor(c.logprobs, dtype=torch.float64)
        gaps.append(float(d.abs().max()))
        kls.append(torch.exp(d) - 1 - d)
    return max(gaps), float(torch.cat(kls).mean())


def lora_policy(model_dir: Path, seed: int) -> Any:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = load_base_model(str(model_dir), torch.device("cpu"), torch.float32)
    targets = resolve_lora_targets(base, "all-linear")
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets,
                                            exclude_modules=excluded_modules(base)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model.eval()


def full_policy(model_dir: Path, seed: int) -> Any:
    """Every weight moved, tied embeddings (= the lm_head) included (`tidal.inference.backends.vllm.tied_head`)."""
    torch.manual_seed(seed)
    model = load_base_model(str(model_dir), torch.device("cpu"), torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def reload(s: Served, weights_dir: Path) -> None:
    """vLLM reloads the weights in `weights_dir` in place (what `weight_broadcast.reload: merged` does)."""
    async def go():
        client = VllmClient(ClientSection(base_url=[s.url]))
        try:
            await client.reload_weights(str(weights_dir))
        finally:
            await client.close()
    asyncio.run(go())


def reload_merged(s: Served, model: Any, out: Path) -> None:
    """Publish `model` as tidal does (`reload_keys`: a MoE LoRA policy without its experts) and reload it."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    keys = reload_keys(model, checkpoint_keys(s.model_dir))
    save_file(merged_state_dict(model, keys), str(out / "model.safetensors"))
    reload(s, out)


def reset(s: Served, out: Path) -> None:
    """Serve the base weights again (MoE: all but the experts, which vLLM-CPU garbles on reload and which the
    LoRA checks leave as loaded)."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    base = load_file(str(s.model_dir / "model.safetensors"))
    save_file({k: v for k, v in base.items() if ARCHS[s.name].cpu_full_updates or not is_expert_key(k)},
              str(out / "model.safetensors"))
    reload(s, out)


def push(s: Served, policy: Any) -> None:
    pusher = WeightPusher([s.url], "127.0.0.1", free_port(), timeout_s=120, api_key=None, device=torch.device("cpu"))
    try:
        pusher.push(policy, 1)
    finally:
        pusher.close()
    assert s.proc.poll() is None, s.log.read_text()[-2000:]


def base_model(s: Served) -> Any:
    return load_base_model(str(s.model_dir), torch.device("cpu"), torch.float32)


def test_vllm_serves_it_and_the_trainer_agrees(served):
    gap, kl = agreement(base_model(served), served)
    assert kl <= 1e-3 and gap < 1e-3, f"{served.name}: trainer vs vLLM gap {gap}, mismatch KL {kl}"


def test_a_lora_adapter_loads_into_vllm_and_is_served_exactly(served, tmp_path):
    policy = lora_policy(served.model_dir, 1)
    policy.save_pretrained(str(tmp_path / "adapter"))
    r = httpx.post(served.url.removesuffix("/v1") + "/v1/load_lora_adapter",
                   json={"lora_name": "a1", "lora_path": str(tmp_path / "adapter")}, timeout=120)
    if not ARCHS[served.name].vllm_lora:  # MoE on CPU: served without LoRA (tidal refuses it up front), so the
        # adapter cannot be loaded, and tidal publishes merged weights instead (the merged test below)
        from tidal.config.load import ConfigError
        from tidal.models.arch import check_cpu_moe_lora, read_arch

        assert r.status_code != 200, "a MoE server on CPU runs without LoRA"
        with pytest.raises(ConfigError, match="cannot be served by vLLM on CPU with LoRA enabled"):
            check_cpu_moe_lora(read_arch(served.model_dir), str(served.model_dir), on_cpu=True, enable_lora=True)
        return
    assert r.status_code == 200, r.text
    gap, kl = agreement(policy, served, "a1")
    assert gap < 1e-3 and kl <= 1e-3, f"{served.name}: vLLM serves the adapter differently (gap {gap}, KL {kl})"
    assert agreement(base_model(served), served, "a1")[0] > 1e-2, "the adapter must change the served policy"


def test_a_lora_policy_reloaded_as_merged_weights_is_served_exactly(served, tmp_path):
    reset(served, tmp_path / "base")
    policy = lora_policy(served.model_dir, 2)
    reload_merged(served, policy, tmp_path / "merged")
    gap, kl = agreement(policy, served)
    assert gap < 1e-3 and kl <= 1e-3, f"{served.name}: reloaded weights served differently (gap {gap}, KL {kl})"
    assert agreement(base_model(served), served)[0] > 1e-2, "the reload must change the served weights"


def test_a_pushed_lora_policy_is_served_exactly(served, tmp_path):
    reset(served, tmp_path / "base")
    policy = lora_policy(served.model_dir, 3)
    push(served, policy)
    gap, kl = agreement(policy, served)
    assert gap < 1e-3 and kl <= 1e-3, f"{served.name}: pushed weights served differently (gap {gap}, KL {kl})"


def identity_gap(s: Served, policy: Any, base: Any, served_name: str | None = None) -> float:
    """The policy identity check (`tidal.orchestrator.identity.check_served`, what the orchestrator runs after each
    load) of `policy` as vLLM serves it now; raises `PolicyMismatch` when it fails. Returns the probe gap."""
    from tidal.orchestrator.identity import check_served
    from tidal.trainer.model.load import load_tokenizer
    from tidal.trainer.publish.probe import Prober

    record = Prober(base, load_tokenizer(str(s.model_dir))).record(policy, 1)

    async def go() -> float:
        client = VllmClient(ClientSection(base_url=[s.url]))
        try:
            v = await check_served(lambda ids: client.prompt_logprobs(served_name or str(s.model_dir), ids), record,
                                   what="vLLM", path=s.name, off="-")
            return v.gap_new
        finally:
            await client.close()
    return asyncio.run(go())


def test_the_policy_identity_check_is_quiet_on_every_path(served, tmp_path):
    """LoRA adapter (unless MoE on CPU), merged LoRA reload, push, and (unless MoE on CPU, whose experts vLLM-CPU
    garbles on update) a fully fine-tuned policy reloaded: the served policy is within the float32 tolerance of the
    trainer's on the probe, and far from the base (so the check would see a stale one)."""
    from tidal.trainer.model.load import load_tokenizer
    from tidal.trainer.publish.probe import Prober
    from tidal.transport.probe import TOLERANCE, distance

    tol, gaps = TOLERANCE["float32"], {}
    policy = lora_policy(served.model_dir, 5)
    reset(served, tmp_path / "base0")  # an earlier test pushed a policy into the base weights
    if ARCHS[served.name].vllm_lora:
        policy.save_pretrained(str(tmp_path / "adapter"))
        r = httpx.post(served.url.removesuffix("/v1") + "/v1/load_lora_adapter",
                       json={"lora_name": "probe", "lora_path": str(tmp_path / "adapter")}, timeout=120)
        assert r.status_code == 200, r.text
        gaps["lora"] = identity_gap(served, policy, policy, "probe")
    reset(served, tmp_path / "base")
    reload_merged(served, policy, tmp_path / "merged")
    gaps["merged"] = identity_gap(served, policy, policy)
    reset(served, tmp_path / "base2")
    push(served, policy)
    gaps["push"] = identity_gap(served, policy, policy)
    if ARCHS[served.name].cpu_full_updates:
        full = full_policy(served.model_dir, 6)
        reload_merged(served, full, tmp_path / "full")
        gaps["full"] = identity_gap(served, full, base_model(served))
    assert all(g < tol / 10 for g in gaps.values()), (served.name, gaps)
    record = Prober(policy, load_tokenizer(str(served.model_dir))).record(policy, 1)
    assert record.base is not None and distance(record.new, record.base) > tol, "a stale base would be seen"


@pytest.mark.parametrize("how", ["reload", "push"])
def test_a_fully_fine_tuned_policy_reaches_vllm_exactly(served, tmp_path, how):
    """Last for each server: on MoE it checks that vLLM-CPU still garbles experts updated in place (the reason
    full fine-tuning of MoE on CPU is refused); when that starts to fail, vLLM has fixed it."""
    policy = full_policy(served.model_dir, 4)
    if how == "reload":
        reload_merged(served, policy, tmp_path / "merged")
    else:
        push(served, policy)
    gap, kl = agreement(policy, served)
    if ARCHS[served.name].cpu_full_updates:
        assert gap < 1e-3 and kl <= 1e-3, f"{served.name}: full weights served differently (gap {gap}, KL {kl})"
    else:
        assert gap > 1e-2, (f"{served.name}: vLLM-CPU now serves experts updated in place exactly (gap {gap}): "
                            "allow full fine-tuning of MoE on CPU (tidal.colocate.derive.moe_on_cpu), update "
                            "tests/archs.py and docs/models.md")


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in GRPO_RUN_DEFAULT else pytest.mark.slow, id=n)
                                  for n, arch in ARCHS.items() if not arch.cpu_refused])
def test_a_two_step_grpo_run_completes(name, tmp_path):
    from tidal.monitor.metrics import read_metrics

    model_dir = build(name, tmp_path / "model")
    run_dir = tmp_path / "run"
    proc = tidal("grpo", "--model", str(model_dir), "--output-dir", str(run_dir), "--infer.port", str(free_port()),
                 "--orch.max_steps", "2", "--orch.batch_size", "8", "--orch.rollouts_per_example", "4",
                 "--orch.sampling.max_tokens", "16")
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["mismatch_kl"] <= 1e-3, f"{name}: step-1 mismatch KL {rows[0]['mismatch_kl']}"
    shutil.rmtree(model_dir)


def test_an_image_prompt_to_a_vlms_text_path_is_refused_by_name(served):
    """A VLM checkpoint served on its text path (`--language-model-only`): an image prompt is the same clear
    `NotMultimodal` error as for a text model (tests/integration/test_vlm_text_model.py), not a retried failure."""
    import random

    from tests.e2e.vlm_env import SquareColour
    from tidal.config.orch import OrchConfig
    from tidal.inference.protocol import NotMultimodal
    from tidal.orchestrator.groups import draw_prompts

    if ARCHS[served.name].vision is None:
        pytest.skip("a text model: tests/integration/test_vlm_text_model.py")

    async def go() -> None:
        client = VllmClient(ClientSection(base_url=[served.url]))
        try:
            await draw_prompts(SquareColour(), random.Random(0), client, str(served.model_dir), 2, OrchConfig(), {})
        finally:
            await client.close()

    with pytest.raises(NotMultimodal, match="takes text only"):
        asyncio.run(go())
