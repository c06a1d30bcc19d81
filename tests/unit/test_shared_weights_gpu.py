"""Shared base weights on a GPU (`gpu` marker; run on a machine with CUDA vLLM, e.g. the GPU kit):

- CUDA IPC handles as JSON open another process's tensors without a copy (`tidal.inference.backends.vllm.ipc`);
- a real vLLM server with infer `export_base_weights` hands its tensors to the trainer, whose base built from
  them (`tidal.trainer.model.shared_base`) gives the logprobs of the trainer's own loaded copy (bf16: exactly the same
  weights, so to bf16 matmul noise) and agrees with vLLM's sampling logprobs as the non-shared trainer does
  (mismatch KL of both within 1e-3 of each other); the trainer's GPU memory grows by far less than the weights.

`pytest -m gpu tests/unit/test_shared_weights_gpu.py -q` (docs/colocate.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import free_port, kill_group, tidal, wait_healthy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

PRODUCER = textwrap.dedent("""
    import json, sys, torch
    from tidal.inference.backends.vllm.ipc import device_uuid, encode
    torch.manual_seed(0)
    fused = torch.randn(48, 16, device="cuda", dtype=torch.bfloat16)
    print(json.dumps({"uuid": device_uuid(0), "fused": encode(fused), "sum": float(fused.float().sum()),
                      "rows": fused[16:40].float().tolist()}), flush=True)
    sys.stdin.readline()  # keeps the producer (and its memory) alive until the consumer is done
""")


def test_ipc_handles_open_another_process_tensor_without_a_copy():
    from tidal.inference.backends.vllm.ipc import decode, local_index

    proc = subprocess.Popen([sys.executable, "-c", PRODUCER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        msg = json.loads(proc.stdout.readline())
        index = local_index(msg["uuid"])
        assert index is not None
        before = torch.cuda.memory_allocated(index)
        fused = decode(json.loads(json.dumps(msg["fused"])), index)
        assert torch.cuda.memory_allocated(index) == before  # mapped, not allocated by this process's allocator
        assert fused.dtype == torch.bfloat16 and fused.shape == (48, 16)
        assert float(fused.float().sum()) == msg["sum"]
        view = fused.narrow(0, 16, 24)  # a "k_proj" of a fused tensor: contiguous, same memory
        assert view.is_contiguous() and view.data_ptr() == fused.data_ptr() + 16 * 16 * 2
        assert view.float().tolist() == msg["rows"]
    finally:
        if proc.stdin is not None:
            proc.stdin.write("\n")
            proc.stdin.flush()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[Path, str]]:
    """vLLM (bf16, LoRA on) with tidal's worker extension on a tiny Llama 3 model; yields (model dir, URL)."""
    from tests.archs import build

    root = tmp_path_factory.mktemp("shared")
    model_dir = build("llama3", root / "model")
    port, log = free_port(), root / "infer.log"
    with open(log, "w") as f:
        proc = tidal("grpo-infer", "--infer.model", str(model_dir), "--infer.port", str(port), "--infer.dtype",
                     "bfloat16", "--infer.export_base_weights", "true", "--infer.max_model_len", "256",
                     "--infer.gpu_memory_utilization", "0.3", stdout=f)
        try:
            wait_healthy(port, proc, timeout=900)
        except Exception:
            kill_group(proc)
            raise RuntimeError(log.read_text()[-3000:]) from None
        yield model_dir, f"http://127.0.0.1:{port}/v1"
        kill_group(proc)


def test_trainer_on_vllms_weights_matches_its_own_copy_and_vllm(served):
    from tests.integration.test_arch_matrix import Served, agreement
    from tidal.config.train import TrainConfig
    from tidal.trainer.model.load import load_policy

    model_dir, url = served
    own, device = load_policy(TrainConfig(model=str(model_dir), device="cuda:0", share_base_weights=False))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    shared, _ = load_policy(TrainConfig(model=str(model_dir), device="cuda:0", share_base_weights=True,
                                        base_weights_url=url))
    grown = torch.cuda.memory_allocated() - before
    base_bytes = sum(p.numel() * p.element_size() for n, p in own.named_parameters() if "lora_" not in n)
    assert grown < base_bytes / 4, (grown, base_bytes)  # LoRA + norms only; the base is vLLM's memory
    frozen = [p for n, p in shared.named_parameters() if "lora_" not in n and not n.endswith("norm.weight")]
    assert frozen and not any(p.requires_grad for p in frozen)
    ids = torch.randint(0, 128, (1, 64), device=device, generator=torch.Generator(device).manual_seed(0))
    pos = torch.arange(64, device=device)[None]
    from tidal.trainer.step.logprobs import forward_logprobs

    with torch.no_grad():
        a = forward_logprobs(own.eval(), ids, pos, 1.0).double()
        b = forward_logprobs(shared.eval(), ids, pos, 1.0).double()
    assert float((a - b).abs().max()) < 2e-2  # the same bf16 weights; bf16 tolerance
    s = Served("llama3", model_dir, url, None, model_dir / "none.log")
    gap_own, kl_own = agreement(own, s)
    gap_shared, kl_shared = agreement(shared, s)
    assert abs(kl_shared - kl_own) < 1e-3 and kl_shared < 1e-2, (kl_own, kl_shared, gap_own, gap_shared)
