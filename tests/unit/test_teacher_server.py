"""The teacher server `tidal grpo` starts (`tidal.colocate.teacher`): its derived config and placement, and its
share of a GPU in the co-locate split, as pure arithmetic (no GPU needed)."""

from __future__ import annotations

import functools
import math

import pytest

from tidal.colocate.derive import Machine, ModelFacts, derive_colocate
from tidal.colocate.split import (
    GIB,
    KV_BLOCK_TOKENS,
    KV_HEADROOM,
    VLLM_OUTSIDE_GIB,
    gpu_share,
    kv_bytes_per_token,
    split_updates,
)
from tidal.colocate.teacher import reserved_gib, teacher_infer, teacher_need
from tidal.config import ConfigError, InferConfig, OrchConfig, TrainConfig

QWEN3_0_6B = {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
              "tie_word_embeddings": True, "dtype": "bfloat16"}
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "tie_word_embeddings": False, "dtype": "bfloat16"}
P_0_6B, P_8B = 596_049_920, 8_190_735_360
CPU2 = Machine(cores=(0, 1))
H100 = Machine(cores=tuple(range(16)), has_gpu=True, gpu_memory_gib=79.18)


def orch(**teacher) -> OrchConfig:
    return OrchConfig.model_validate({"batch_size": 64, "rollouts_per_example": 8, "seq_len": 1024,
                                      "teacher": {"model": "tidal:tiny-reverse", **teacher}})


def test_the_teacher_config_follows_the_policy_server_on_the_next_port_without_lora():
    infer = InferConfig(model="m", port=8100, dp=2, dtype="bfloat16", max_model_len=None, kv_cache_dtype="fp8",
                        cpu_kvcache_space_gib=3.0, log_stats=False, seed=5)
    t = teacher_infer(infer, orch())
    assert (t.model, t.port, t.dp, t.tp, t.enable_lora, t.weight_reload) == ("tidal:tiny-reverse", 8102, 1, 1,
                                                                            False, False)
    assert t.weight_broadcast_type == "filesystem"
    assert (t.dtype, t.max_model_len, t.kv_cache_dtype, t.cpu_kvcache_space_gib, t.log_stats, t.seed) == (
        "bfloat16", 1024, "fp8", 3.0, False, 5)


def test_on_cpu_the_teacher_shares_vllms_cores_and_the_orchestrator_is_pointed_at_it():
    co = derive_colocate(TrainConfig(model="tidal:tiny-reverse"), InferConfig(model="tidal:tiny-reverse", port=8300),
                         orch(), CPU2)
    server = co.teacher
    assert server is not None
    assert server.base_url == "http://127.0.0.1:8301/v1" == co.orch.teacher.base_url  # type: ignore[union-attr]
    assert server.health_url == "http://127.0.0.1:8301/health"
    # on-policy (CPU default): the teacher scores in the rollout phase, on every core like vLLM
    assert server.env == {"VLLM_CPU_OMP_THREADS_BIND": "0,1"} == co.placement.infer_env
    assert server.infer.dtype == "float32" and server.infer.gpu_memory_utilization == 0.9  # untouched on CPU
    assert server.reserved_gib == 0.0 and co.train.cpu_affinity == [0, 1]
    lag = derive_colocate(TrainConfig(model="tidal:tiny-reverse"), InferConfig(model="tidal:tiny-reverse", port=8300),
                          orch().model_copy(update={"max_async_level": 1}), CPU2)
    assert lag.teacher is not None and lag.teacher.env == {"VLLM_CPU_OMP_THREADS_BIND": "0"}  # the trainer: core 1
    assert lag.train.cpu_affinity == [1]


def test_a_teacher_with_an_address_is_the_users_to_run():
    co = derive_colocate(TrainConfig(model="m"), InferConfig(model="m"), orch(base_url="http://h:9/v1"), CPU2)
    assert co.teacher is None and co.orch.teacher is not None and co.orch.teacher.base_url == "http://h:9/v1"
    co = derive_colocate(TrainConfig(model="m"), InferConfig(model="m"), OrchConfig(), CPU2)
    assert co.teacher is None and co.orch.teacher is None


def test_several_gpus_are_refused_with_the_three_process_command():
    with pytest.raises(ConfigError, match="grpo-infer --model tidal:tiny-reverse"):
        derive_colocate(TrainConfig(model="m", gpus=2), InferConfig(model="m"), orch(), H100)


def test_the_teachers_gpu_need_by_hand():
    o = orch(max_concurrency=4)
    t = teacher_infer(InferConfig(model="m", dtype="bfloat16"), o)
    need = teacher_need(t, o, 79.18, model_config=QWEN3_8B, params=P_8B)
    assert need.weights == P_8B * 2
    kv_tokens = 4 * math.ceil(1024 / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS  # max_concurrency sequences of seq_len
    assert need.kv_cache == int(kv_tokens * kv_bytes_per_token(QWEN3_8B, "bfloat16") * (1 + KV_HEADROOM))
    without_logprobs = teacher_need(t, o, 79.18, model_config={**QWEN3_8B, "vocab_size": 0}, params=P_8B)
    assert need.profile - without_logprobs.profile == 4 * 1024 * 151936 * 4  # float32 prompt logprobs
    assert need.outside == int(VLLM_OUTSIDE_GIB * GIB) and need.lora == 0
    assert gpu_share(need, 79.18) * 79.18 * GIB >= need.budget > (gpu_share(need, 79.18) - 0.01) * 79.18 * GIB
    assert reserved_gib(need, 79.18) == pytest.approx(gpu_share(need, 79.18) * 79.18 + VLLM_OUTSIDE_GIB)


def split_for(model_config, estimate, reserved=0.0):
    return functools.partial(split_updates, model_config=model_config, kv_bytes_arg=True,
                             estimate_gib=lambda train, ckpt: estimate[ckpt], reserved_gib=reserved)


def test_the_split_reserves_the_teacher_before_sizing_vllm_and_the_trainer():
    train, infer = TrainConfig(model="m"), InferConfig(model="m", dtype="bfloat16")
    o = orch()
    t_need = teacher_need(teacher_infer(infer, o), o, 79.18, model_config=QWEN3_8B, params=P_8B)
    held = reserved_gib(t_need, 79.18)
    assert 17 < held < 22  # 8B bf16 weights 15.3 GiB + its profile, KV cache and CUDA graphs + context
    t_alone, i_alone, _ = split_for(QWEN3_0_6B, {False: 50.0, True: 20.0})(train, infer, o, 79.18)
    t_with, i_with, _ = split_for(QWEN3_0_6B, {False: 50.0, True: 20.0}, held)(train, infer, o, 79.18)
    assert i_with == i_alone  # vLLM is sized by its own need either way
    # 79.18 - vLLM's share - 2.2 outside = room; 50 GiB fits without the teacher, not beside it: checkpointing
    room_alone = 79.18 - i_alone["gpu_memory_utilization"] * 79.18 - VLLM_OUTSIDE_GIB
    assert room_alone >= 50 > room_alone - held >= 20
    assert t_alone == {"gradient_checkpointing": False} and t_with == {"gradient_checkpointing": True}
    # and a trainer that fits beside neither is refused, naming the teacher's share
    split_for(QWEN3_0_6B, {False: 60.0, True: 50.0})(train, infer, o, 79.18)  # fits without a teacher
    with pytest.raises(ConfigError, match=f"a teacher server {held:.1f}"):
        split_for(QWEN3_0_6B, {False: 60.0, True: 50.0}, held)(train, infer, o, 79.18)


def test_derive_colocate_reserves_the_teacher_it_serves_and_gives_it_that_share():
    """On a GPU, `derive_colocate` with the teacher's facts: the trainer's room shrinks by the teacher's need."""
    train, infer = TrainConfig(model="m"), InferConfig(model="m", dtype="bfloat16")
    facts = ModelFacts(architecture="Qwen3ForCausalLM", config=QWEN3_0_6B)
    teacher = ModelFacts(architecture="Qwen3ForCausalLM", config=QWEN3_8B)
    alone = derive_colocate(train, infer, orch(base_url="http://h:9/v1"), H100, model=facts)
    co = derive_colocate(train, infer, orch(), H100, model=facts, teacher=teacher)
    assert alone.teacher is None and co.teacher is not None
    assert co.teacher.infer.gpu_memory_utilization == gpu_share(
        teacher_need(co.teacher.infer, co.orch, 79.18, model_config=QWEN3_8B), 79.18)
    split_notes = [n for n in co.placement.notices if "trainer" in n and "GiB" in n]
    assert split_notes and any("teacher vLLM" in n for n in co.teacher.notices)
    assert co.infer.gpu_memory_utilization == alone.infer.gpu_memory_utilization


def test_on_a_gpu_the_teacher_server_gets_the_share_the_split_reserved():
    machine = Machine(cores=tuple(range(16)), has_gpu=True, gpu_memory_gib=79.18, vllm_kv_cache_memory_bytes=True)
    co = derive_colocate(TrainConfig(model="m"), InferConfig(model="m"), orch(max_concurrency=2), machine,
                         teacher=ModelFacts(config=QWEN3_0_6B))
    server = co.teacher
    assert server is not None and server.env == {}
    t_need = teacher_need(server.infer, co.orch, 79.18, model_config=QWEN3_0_6B, params=P_0_6B)
    assert server.infer.dtype == "bfloat16" == co.infer.dtype
    assert server.infer.gpu_memory_utilization == gpu_share(t_need, 79.18) < 0.1
    assert server.reserved_gib == reserved_gib(t_need, 79.18), "what the split reserved for it"
    assert server.infer.extra_args == ["--kv-cache-memory-bytes", str(t_need.kv_cache)]
    assert any("teacher vLLM" in n for n in server.notices)


def test_tidal_grpo_dry_run_shows_the_teacher_server_and_refuses_a_missing_teacher_model(capsys):
    from tidal.cli import main

    assert main(["grpo", "--dry-run", "--orch.teacher.model", "tidal:tiny-reverse", "--infer.port", "8200",
                 "--orch.advantage.type", "none", "--train.loss.teacher_tau", "1"]) == 0
    out = capsys.readouterr().out
    teacher = out.split("# --- teacher (served by tidal grpo at http://127.0.0.1:8201/v1) ---\n")[1]
    assert "model: tidal:tiny-reverse\n" in teacher and "port: 8201\n" in teacher and "enable_lora: false" in teacher
    assert main(["grpo", "--dry-run", "--orch.teacher.model", "/nonexistent/teacher"]) == 2
    assert "orch teacher: key 'model'" in capsys.readouterr().err
    assert main(["grpo", "--dry-run", "--orch.advantage.type", "none"]) == 2  # reward-free without a teacher term
    assert "teacher_tau is 0" in capsys.readouterr().err
