"""The co-locate GPU split (`tidal.colocate.split`) against the figures measured on an H100 with vLLM 0.24 (issue 26,
2026-11-24), the precision rule (`tidal.inference.precision.couple_precision`) on a fake GPU machine, and what
`derive_colocate` does with both. Pure arithmetic: no GPU needed."""

from __future__ import annotations

import dataclasses

import pytest

from tidal.colocate import split
from tidal.colocate.derive import Machine, ModelFacts, derive_colocate
from tidal.colocate.split import GIB, kv_bytes_per_token, plan_split, trainer_need_gib, vllm_need
from tidal.config import ConfigError, InferConfig, OrchConfig, TrainConfig
from tidal.models.memory import parameter_count, train_estimate

H100_GIB = 79.18
"""Total memory of the H100 the figures come from (torch.cuda.mem_get_info)."""
QWEN3_0_6B = {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
              "tie_word_embeddings": True, "dtype": "bfloat16"}
LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}


def test_kv_bytes_per_token_matches_vllms_cache_on_the_h100():
    # vLLM 0.24 reported a 67.35 GiB KV cache of 630,576 tokens for the 0.6B shape in bf16
    per_token = kv_bytes_per_token(QWEN3_0_6B, "bfloat16")
    assert per_token == 28 * 8 * 128 * 2 * 2
    assert per_token * 630_576 / GIB == pytest.approx(67.35, rel=0.002)
    assert kv_bytes_per_token(LLAMA_8B, "bfloat16") == 32 * 8 * 128 * 2 * 2  # head_dim from hidden / heads
    assert kv_bytes_per_token(QWEN3_0_6B, "float32") == 2 * per_token
    mla = {"num_hidden_layers": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_attention_heads": 16,
           "hidden_size": 1024}
    assert kv_bytes_per_token(mla, "bfloat16") == 4 * 576 * 2


def test_vllm_holds_what_the_model_says_at_the_measured_utilization():
    # at gpu_memory_utilization 0.88 vLLM held 71.89 GiB: the share plus what it holds beyond it
    assert 0.88 * H100_GIB + split.VLLM_OUTSIDE_GIB == pytest.approx(71.89, abs=0.02)
    # and inside the share: weights + profile + the 67.35 GiB KV cache it filled the rest with
    need = vllm_need(QWEN3_0_6B, "bfloat16", 1, 16, parameter_count(QWEN3_0_6B))
    assert (need.weights + need.profile) / GIB + 67.35 == pytest.approx(0.88 * H100_GIB, abs=0.02)


def test_the_bundled_run_shape_sizes_vllm_by_need_on_the_h100():
    orch = OrchConfig.model_validate({"batch_size": 128, "rollouts_per_example": 16, "seq_len": 512})
    seqs = split.sequences_in_flight(orch, 1024)
    assert seqs == 128  # 8 prompts x 16 rollouts: gated mode samples one batch at a time
    need = vllm_need(QWEN3_0_6B, "bfloat16", seqs, 512, parameter_count(QWEN3_0_6B))
    tokens = need.kv_cache / kv_bytes_per_token(QWEN3_0_6B, "bfloat16")
    assert 65_536 <= tokens <= 65_536 * 1.11  # the run's 65,536 tokens plus headroom, not 630,576
    plan = plan_split(H100_GIB, need, sequences=seqs, seq_len=512, kv_bytes_arg=True, checkpointing="auto",
                      estimate_gib=lambda ckpt: 14.4 if not ckpt else 3.6)
    assert plan.gradient_checkpointing is False  # fits without: no recomputation
    assert plan.vllm_gib < 15 and plan.trainer_room_gib > 60
    assert plan.kv_cache_memory_bytes == need.kv_cache
    assert plan.gpu_memory_utilization * H100_GIB * GIB >= need.budget  # vLLM's own start check passes
    assert plan.vllm_gib + plan.trainer_room_gib == pytest.approx(H100_GIB)


def test_servers_share_the_sequences_and_tensor_parallel_ranks_the_model():
    orch = OrchConfig.model_validate({"batch_size": 256, "rollouts_per_example": 16, "seq_len": 512})
    assert split.sequences_in_flight(orch, 1024) == 256 and split.sequences_in_flight(orch, 1024, servers=2) == 128
    assert split.sequences_in_flight(orch, 100) == 100  # vLLM runs at most max_num_seqs at once
    inflight = OrchConfig.model_validate({"batch_size": 64, "rollouts_per_example": 8, "async_mode": "in_flight"})
    assert split.sequences_in_flight(inflight, 1024) == 128  # two batches' worth of groups
    params = parameter_count(LLAMA_8B)
    one, two = (vllm_need(LLAMA_8B, "bfloat16", 64, 1024, params, tp=tp) for tp in (1, 2))
    assert two.weights == one.weights // 2 and two.kv_cache == one.kv_cache // 2 and two.outside == one.outside


def test_checkpointing_auto_turns_on_only_where_the_share_needs_it():
    need = vllm_need(QWEN3_0_6B, "bfloat16", 128, 512, parameter_count(QWEN3_0_6B))
    room = H100_GIB - need.total / GIB
    calls: list[bool] = []

    def measured(ckpt: bool) -> float:
        calls.append(ckpt)
        return 10.0

    on = plan_split(H100_GIB, need, sequences=128, seq_len=512, kv_bytes_arg=False, checkpointing="auto",
                    estimate_gib=lambda ckpt: room + 5 if not ckpt else 20.0, measure_gib=measured)
    assert on.gradient_checkpointing is True and on.kv_cache_memory_bytes is None
    assert on.measured_gib == 10.0 and "measured 10.0 GiB" in on.notice() and "checkpointing on" in on.notice()
    assert calls == [True], "an estimate that does not fit is not measured"
    # a measured peak above the estimate decides too: off would not fit once measured
    calls.clear()
    on2 = plan_split(H100_GIB, need, sequences=128, seq_len=512, kv_bytes_arg=True, checkpointing="auto",
                     estimate_gib=lambda ckpt: 10.0, measure_gib=lambda ckpt: room if not ckpt else 5.0)
    assert on2.gradient_checkpointing is True and on2.trainer_gib == pytest.approx(10.0)
    explicit = plan_split(H100_GIB, need, sequences=128, seq_len=512, kv_bytes_arg=True, checkpointing=False,
                          estimate_gib=lambda ckpt: 20.0)
    assert explicit.gradient_checkpointing is False


def test_a_run_that_cannot_fit_exits_2_naming_the_keys():
    need = vllm_need(LLAMA_8B, "bfloat16", 1024, 8192, parameter_count(LLAMA_8B))
    with pytest.raises(ConfigError, match="orch seq_len.*orch batch_size.*per_device_train_batch_size") as exc:
        plan_split(H100_GIB, need, sequences=1024, seq_len=8192, kv_bytes_arg=True, checkpointing="auto",
                   estimate_gib=lambda ckpt: 40.0)
    assert "KV cache" in str(exc.value) and "trainer" in str(exc.value)


def test_trainer_need_is_the_larger_of_estimate_and_measurement():
    assert trainer_need_gib(9.0, None) == 9.0
    assert trainer_need_gib(9.0, 3.0) == 9.0
    assert trainer_need_gib(4.0, 7.27) == pytest.approx((7.27 + split.TRAINER_CONTEXT_GIB) * 1.1)
    assert trainer_need_gib(4.0, float("inf")) == float("inf")  # the calibration itself ran out of memory


GPU = Machine(cores=tuple(range(16)), has_gpu=True, gpu_memory_gib=H100_GIB)


QWEN = ModelFacts(config=QWEN3_0_6B)
"""The 0.6B model's config.json as `tidal grpo` reads it (the split's input; its name need not exist here)."""


def test_derive_colocate_applies_the_split_on_a_gpu_only():
    orch = OrchConfig.model_validate({"batch_size": 128, "rollouts_per_example": 16, "seq_len": 512})
    train = TrainConfig(model="m")
    assert train.gradient_checkpointing == "auto"
    co = derive_colocate(train, InferConfig(model="m"), orch, GPU, model=QWEN)
    assert co.infer.gpu_memory_utilization < 0.2
    assert "--kv-cache-memory-bytes" in co.infer.extra_args
    assert co.train.gradient_checkpointing is False  # resolved for the trainer child
    assert any("KV cache" in n for n in co.placement.notices)
    old_vllm = dataclasses.replace(GPU, vllm_kv_cache_memory_bytes=False)
    old = derive_colocate(train, InferConfig(model="m"), orch, old_vllm, model=QWEN)
    assert "--kv-cache-memory-bytes" not in old.infer.extra_args
    explicit = derive_colocate(train, InferConfig(model="m", gpu_memory_utilization=0.5), orch, GPU,
                               model=QWEN)
    assert explicit.infer.gpu_memory_utilization == 0.5 and explicit.train.gradient_checkpointing == "auto"
    long = derive_colocate(train, InferConfig(model="m"), OrchConfig.model_validate({"seq_len": 4096}), GPU,
                           model=QWEN)
    ckpt = long.train.gradient_checkpointing is True  # resolved by the split (on: 4096-token rows need it)
    needs = {n: train_estimate(train.model_copy(update={"sequence_len": n}), ckpt, model_config=QWEN3_0_6B).total_gib
             for n in (512, 4096)}
    assert needs[4096] > needs[512] + 0.1
    assert any(f"trainer needs {needs[4096]:.1f} of" in n for n in long.placement.notices), \
        "the split sees the derived train config (sequence_len follows orch)"
    cpu = derive_colocate(train, InferConfig(model="m"), orch, Machine(cores=(0, 1)), model=QWEN)
    assert cpu.infer.gpu_memory_utilization == 0.9 and cpu.train.gradient_checkpointing == "auto"


def test_infer_dtype_auto_follows_the_trainer():
    orch, train = OrchConfig(), TrainConfig(model="m")
    assert derive_colocate(train, InferConfig(model="m"), orch, GPU).infer.dtype == "bfloat16"
    fp32 = TrainConfig(model="m", recipe="fp32")
    merged = OrchConfig.model_validate({"weight_broadcast": {"reload": "merged"}})
    assert derive_colocate(fp32, InferConfig(model="m", enable_lora=False), merged, GPU).infer.dtype == "float32"
    cpu = derive_colocate(train, InferConfig(model="m"), orch, Machine(cores=(0, 1)))
    assert cpu.infer.dtype == "float32" and not any("mismatch" in n for n in cpu.placement.notices)
    cpu_bf16 = derive_colocate(TrainConfig(model="m", recipe="bf16"), InferConfig(model="m"), orch,
                               Machine(cores=(0, 1)))
    assert cpu_bf16.infer.dtype == "bfloat16"  # vLLM in bf16 beside the trainer's bf16 matmuls (test_cpu_recipe)


def test_a_16bit_vllm_beside_a_float32_trainer_gets_the_16bit_identity_tolerance():
    """CPU, float32 weights, vLLM asked for bfloat16: the served policy differs by bf16 rounding (a probe gap of
    ~0.05 on SmolLM2, bench/LEARN-68.md), which the float32 tolerance 0.01 would call a wrong policy at step 1."""
    cpu = Machine(cores=(0, 1))
    co = derive_colocate(TrainConfig(model="m", recipe="fp32"), InferConfig(model="m", dtype="bfloat16"),
                         OrchConfig(), cpu)
    assert co.orch.weight_broadcast.policy_check_tolerance == 0.1
    assert any("policy_check_tolerance 0.1" in n for n in co.placement.notices)
    # a bf16 trainer (autocast over float32 weights): its record says bfloat16, whose own tolerance is 0.1
    co = derive_colocate(TrainConfig(model="m", recipe="bf16"), InferConfig(model="m", dtype="bfloat16"),
                         OrchConfig(), cpu)
    assert co.orch.weight_broadcast.policy_check_tolerance is None
    assert not any("policy_check_tolerance" in n for n in co.placement.notices)
    same = derive_colocate(TrainConfig(model="m"), InferConfig(model="m"), OrchConfig(), cpu)  # float32 both
    assert same.orch.weight_broadcast.policy_check_tolerance is None
    mine = OrchConfig.model_validate({"weight_broadcast": {"policy_check_tolerance": 0.02}})  # the user's wins
    co = derive_colocate(TrainConfig(model="m"), InferConfig(model="m", dtype="bfloat16"), mine, cpu)
    assert co.orch.weight_broadcast.policy_check_tolerance == 0.02
    merged = OrchConfig.model_validate({"weight_broadcast": {"reload": "merged"}})  # a bf16 trainer, float32 vLLM
    co = derive_colocate(TrainConfig(model="m"), InferConfig(model="m", dtype="float32", enable_lora=False), merged,
                         GPU)
    assert co.orch.weight_broadcast.policy_check_tolerance is None  # the trainer's bf16 record carries 0.1


def test_float32_vllm_with_lora_on_a_gpu_is_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="infer dtype float32 with enable_lora on a GPU"):
        derive_colocate(TrainConfig(model="m"), InferConfig(model="m", dtype="float32"), OrchConfig(), GPU)
    # merged reloads without LoRA in vLLM run, with a notice that the precisions differ
    merged = OrchConfig.model_validate({"weight_broadcast": {"reload": "merged"}})
    co = derive_colocate(TrainConfig(model="m"), InferConfig(model="m", dtype="float32", enable_lora=False), merged,
                         GPU)
    assert co.infer.dtype == "float32" and any("mismatch_kl" in n for n in co.placement.notices)
    # on CPU float32 + LoRA is what vLLM-CPU runs
    cpu = derive_colocate(TrainConfig(model="m"), InferConfig(model="m", dtype="float32", enable_lora=True),
                          OrchConfig(), Machine(cores=(0, 1)))
    assert cpu.infer.dtype == "float32"


def test_grpo_infer_alone_serves_auto_in_the_default_recipes_dtype():
    """vLLM's own `--dtype auto` serves a float32 model in 16 bits: tidal never passes it."""
    from tidal.inference.backends.vllm.server import on_cpu, vllm_argv

    argv = vllm_argv(InferConfig(model="tidal:tiny-reverse"))
    assert argv[argv.index("--dtype") + 1] == ("float32" if on_cpu() else "bfloat16")  # the default recipe's
    argv = vllm_argv(InferConfig(model="tidal:tiny-reverse", dtype="bfloat16"))
    assert argv[argv.index("--dtype") + 1] == "bfloat16"


def test_tidal_grpo_wires_the_split_for_its_model_directory():
    """`tidal grpo`'s split for the bundled model on a fake H100 (the real estimate, no calibration: CPU here)."""
    model = "tidal:tiny-reverse"
    co = derive_colocate(TrainConfig(model=model), InferConfig(model=model), OrchConfig(), GPU,
                         model=ModelFacts.read(model))
    assert co.infer.dtype == "bfloat16" and co.train.gradient_checkpointing is False
    assert 0 < co.infer.gpu_memory_utilization <= 0.05  # not 0.98: a 13 MB model's KV cache and overhead
    kv = int(co.infer.extra_args[co.infer.extra_args.index("--kv-cache-memory-bytes") + 1])
    assert kv == split.kv_need_bytes({"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
                                      "head_dim": 32, "hidden_size": 256}, "bfloat16", 128, 2048)


def test_an_fp8_kv_cache_halves_vllms_cache_of_a_bf16_model():
    params = parameter_count(LLAMA_8B)
    bf16 = vllm_need(LLAMA_8B, "bfloat16", 8, 20480, params)
    fp8 = vllm_need(LLAMA_8B, "bfloat16", 8, 20480, params, kv_dtype="fp8")
    assert fp8.kv_cache * 2 == pytest.approx(bf16.kv_cache, rel=1e-6)
    assert fp8.weights == bf16.weights


def test_vllm_serves_no_longer_than_the_kv_cache_it_is_given():
    """The KV cache is sized for orch seq_len; vLLM 0.24 refuses to start when its cache cannot hold one request of
    max_model_len (unset: the model's context, 40,960 for Qwen3), so the split sets max_model_len = seq_len
    unless infer.yaml sets it (issue 33, read in vllm/v1/core/kv_cache_utils.py)."""
    orch = OrchConfig.model_validate({"batch_size": 8, "rollouts_per_example": 8, "seq_len": 1024})
    co = derive_colocate(TrainConfig(model="m"), InferConfig(model="m"), orch, GPU, model=QWEN)
    assert co.infer.max_model_len == 1024
    kv = int(co.infer.extra_args[co.infer.extra_args.index("--kv-cache-memory-bytes") + 1])
    assert kv >= 1024 * kv_bytes_per_token(QWEN3_0_6B, "bfloat16")  # one request of max_model_len fits
    kept = derive_colocate(TrainConfig(model="m"), InferConfig(model="m", max_model_len=2048), orch, GPU,
                           model=QWEN)
    assert kept.infer.max_model_len == 2048


QWEN3_8B = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128}


def test_lora_slots_are_counted_in_vllms_share():
    """vLLM allocates max_loras x rank x (in + out) per wrapped module and layer at start (vllm/lora/layers/
    base_linear.py): Qwen3-8B, all-linear, 8 slots of rank 64 in bf16 is 2.6 GiB, outside the measured constant."""
    per_layer = sum(i + o for i, o in [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 12288),
                                        (4096, 12288), (12288, 4096)])
    want = 36 * per_layer * 64 * 8 * 2
    assert split.lora_slot_bytes(QWEN3_8B, "bfloat16", 8, 64, "all-linear") == want
    assert want / GIB == pytest.approx(2.6, abs=0.05)
    fused = split.lora_slot_bytes(QWEN3_8B, "bfloat16", 8, 64, ["qkv_proj", "gate_up_proj", "o_proj", "down_proj"])
    # Phi-3's fused names are one adapter each (one A for q/k/v together): fewer slots
    assert fused == 36 * ((4096 + 6144) + (4096 + 24576) + (4096 + 4096) + (12288 + 4096)) * 64 * 8 * 2
    assert split.lora_slot_bytes(QWEN3_8B, "bfloat16", 8, 64, ["q_proj"]) == 36 * 8192 * 64 * 8 * 2
    base = vllm_need(QWEN3_0_6B, "bfloat16", 64, 512, parameter_count(QWEN3_0_6B))
    with_lora = vllm_need(QWEN3_0_6B, "bfloat16", 64, 512, parameter_count(QWEN3_0_6B), lora=GIB)
    assert with_lora.budget - base.budget == GIB
    orch = OrchConfig.model_validate({"batch_size": 64, "rollouts_per_example": 8, "seq_len": 512})
    lora = OrchConfig.model_validate({**orch.model_dump(), "weight_broadcast": {"reload": "lora"}})
    on = derive_colocate(TrainConfig(model="m"), InferConfig(model="m", max_loras=8, max_lora_rank=64), lora, GPU,
                         model=QWEN)
    merged = OrchConfig.model_validate({**orch.model_dump(), "weight_broadcast": {"reload": "merged"}})
    off = derive_colocate(TrainConfig(model="m"), InferConfig(model="m", max_loras=8, max_lora_rank=64), merged,
                          GPU, model=QWEN)
    assert not off.infer.enable_lora
    assert on.infer.gpu_memory_utilization > off.infer.gpu_memory_utilization
