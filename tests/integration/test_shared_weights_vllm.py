"""tidal's vLLM worker extension in a real vLLM server (CPU): vLLM mixes it into its worker and the dev route
`/collective_rpc` reaches its methods and returns their JSON; the served names carry LoRA's `base_layer` level,
which the mapping strips. On CPU vLLM repacks the linear weights for its GEMM kernels after loading (the
parameters are left empty), so the mapping refuses that layout (a GPU keeps the loaded layout: the CUDA path is
tests/unit/test_shared_weights_gpu.py), and the IPC export refuses CPU tensors.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.archs import build
from tests.conftest import free_port, kill_group, tidal, wait_healthy
from tidal.inference.backends.vllm.server import WORKER_EXTENSION
from tidal.models.shared_weights import SharingRefused, view_plan

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, object]]:
    root = tmp_path_factory.mktemp("ext")
    model_dir = build("llama3", root / "model")
    port, log = free_port(), root / "infer.log"
    with open(log, "w") as f:  # the extension by hand: tidal grpo-infer refuses export_base_weights on CPU
        proc = tidal("grpo-infer", "--infer.model", str(model_dir), "--infer.port", str(port), "--infer.weight_reload",
                     "true", "--infer.max_model_len", "256", "--infer.extra_args",
                     f'["--worker-extension-cls", "{WORKER_EXTENSION}"]', stdout=f)
        try:
            wait_healthy(port, proc)
        except Exception:
            kill_group(proc)
            raise RuntimeError(log.read_text()[-3000:]) from None
        yield f"http://127.0.0.1:{port}", model_dir
        kill_group(proc)


def test_the_extension_answers_through_collective_rpc(server):
    from transformers import AutoModelForCausalLM

    root, model_dir = server
    resp = httpx.post(f"{root}/collective_rpc", json={"method": "tidal_base_layout"}, timeout=60)
    assert resp.status_code == 200, resp.text
    (layout,) = resp.json()["results"]
    tensors = layout["tensors"]
    assert layout["device"] == "cpu"
    assert "model.layers.0.self_attn.qkv_proj.base_layer.weight" in tensors  # LoRA enabled: wrapped
    assert tensors["model.layers.0.input_layernorm.weight"] == {"shape": [128], "dtype": "float32"}
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir))
    shapes = {n: tuple(p.shape) for n, p in hf.named_parameters()}
    with pytest.raises(SharingRefused, match="does not fit"):  # CPU prepack: the linear weights are empty
        view_plan("LlamaForCausalLM", shapes, {n: tuple(t["shape"]) for n, t in tensors.items()})
    bad = httpx.post(f"{root}/collective_rpc", json={"method": "tidal_export_base"}, timeout=60)
    assert bad.status_code != 200
