"""Real vLLM (grpo-infer) on the bundled model: token ids, logprobs that match the trainer, LoRA reload."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import httpx
import pytest
import torch

from tests.conftest import MODEL
from tidal.config.orch import ClientSection
from tidal.inference.backends.vllm.client import VllmClient
from tidal.inference.protocol import InferenceUnreachable
from tidal.trainer.model.load import load_base_model, load_tokenizer
from tidal.trainer.step.logprobs import forward_logprobs

pytestmark = pytest.mark.vllm

MESSAGES = [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": "hello world"}]


def sample(url: str, model: str, n: int = 8, temperature: float = 1.0):
    async def go():
        client = VllmClient(ClientSection(base_url=[url]))
        try:
            await client.wait_ready()
            prompt = await client.tokenize_chat(MODEL, MESSAGES)
            return prompt, await client.sample(model, prompt, n, 40, temperature, seed=123)
        finally:
            await client.close()
    return asyncio.run(go())


def trainer_logprobs(model, prompt, comp, temperature):
    ids = torch.tensor([prompt + comp.token_ids])
    with torch.no_grad():
        lp = forward_logprobs(model, ids, torch.arange(ids.shape[1])[None], temperature)
    return lp[0, len(prompt):]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_vllm_tokens_and_logprobs_match_the_trainer(vllm_server, temperature):
    tok = load_tokenizer(MODEL)
    prompt, comps = sample(vllm_server, MODEL, temperature=temperature)
    assert prompt == tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)["input_ids"]
    model = load_base_model(MODEL, torch.device("cpu"), torch.float32).eval()
    worst = 0.0
    for c in comps:
        assert len(c.token_ids) == len(c.logprobs) > 0
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == tok.eos_token_id, "the EOS token must be part of the trained tokens"
        ours = trainer_logprobs(model, prompt, c, temperature)
        worst = max(worst, float((ours - torch.tensor(c.logprobs)).abs().max()))
    assert worst < 1e-4, f"trainer vs vLLM logprob gap {worst}"


def test_lora_adapter_loaded_at_runtime_is_served_exactly(vllm_server, tmp_path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = load_base_model(MODEL, torch.device("cpu"), torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # a non-trivial adapter
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    r = httpx.post(vllm_server.removesuffix("/v1") + "/v1/load_lora_adapter",
                   json={"lora_name": "test-adapter", "lora_path": str(tmp_path / "adapter")}, timeout=60)
    assert r.status_code == 200, r.text
    prompt, comps = sample(vllm_server, "test-adapter")
    peft_model.eval()
    base_model = load_base_model(MODEL, torch.device("cpu"), torch.float32).eval()
    gap_adapter, gap_base = 0.0, 0.0
    for c in comps:
        served = torch.tensor(c.logprobs)
        gap_adapter = max(gap_adapter, float((trainer_logprobs(peft_model, prompt, c, 1.0) - served).abs().max()))
        gap_base = max(gap_base, float((trainer_logprobs(base_model, prompt, c, 1.0) - served).abs().max()))
    assert gap_adapter < 1e-4, f"vLLM serves the adapter differently from PEFT (gap {gap_adapter})"
    assert gap_base > 1e-2, "the adapter must actually change the served policy"


def test_port_in_use_is_a_clear_error_and_leaves_nothing_running():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo-infer", "--infer.port", str(port)],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert f"127.0.0.1:{port}" in r.stderr and "port" in r.stderr


def test_unreachable_inference_retries_then_names_the_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    cfg = ClientSection(base_url=[f"http://127.0.0.1:{port}/v1"], connect_timeout_s=2.0)

    async def go():
        client = VllmClient(cfg)
        try:
            await client.wait_ready()
        finally:
            await client.close()
    with pytest.raises(InferenceUnreachable, match=f"127.0.0.1:{port}/v1"):
        asyncio.run(go())


def test_grpo_orch_exits_naming_the_url_when_inference_is_unreachable(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "tidal.cli", "grpo-orch", "--output-dir", str(tmp_path / "run"),
                        "--orch.client.base_url", f"[http://127.0.0.1:{port}/v1]",
                        "--orch.client.connect_timeout_s", "3"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert f"http://127.0.0.1:{port}/v1" in r.stdout + r.stderr and "unreachable" in r.stdout + r.stderr
    assert "retry in" in r.stdout + r.stderr, "it must have retried before giving up"
