"""The step's time by kind (`tidal.trainer.profile`, `bench/gpu_trainer.py --profile`): the attribution is exact on
hand-made spans, each rule gives its row, and a real CPU training step (a one-layer Llama, LoRA, checkpointing) profiled
with torch.profiler fills every row; its wall time, device-busy time and range-labelled rows equal what an interval
union of the raw profiler events gives."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tidal.trainer.profile import (
    ATTENTION,
    HOST_GAP,
    KINDS,
    LM_HEAD,
    OPTIMIZER,
    RECOMPUTE,
    STEP,
    Span,
    attribute,
    breakdown,
    classify,
    markdown,
    profile_steps,
)


def test_busy_time_goes_to_the_innermost_span_and_the_rest_is_host_gap():
    """[0, 100] wall: a matmul 10-40 with a LoRA mm nested at 20-30, an elementwise op 35-50 overlapping the matmul
    (35-40 goes to it: the later-started span is the innermost), an optimizer op 70-120 (clipped at 100)."""
    spans = [Span(10, 40, ("aten::mm",), ((64, 64), (64, 64))), Span(20, 30, ("aten::mm",), ((64, 4), (4, 64))),
             Span(35, 50, ("aten::mul",)), Span(70, 120, ("aten::_foreach_add_", OPTIMIZER))]
    out = attribute(spans, 0, 100, lora_rank=4)
    assert list(out) == list(KINDS)
    assert out["base matmuls"] == 15 and out["LoRA matmuls"] == 10  # 10-20 and 30-35; 20-30
    assert out["norms, activations, RoPE, other elementwise"] == 15  # 35-50
    assert out["optimizer"] == 30 and out[HOST_GAP] == 30  # 70-100; 0-10 and 50-70
    assert sum(v for k, v in out.items() if k not in ("base matmuls",)) + out["base matmuls"] == 100


@pytest.mark.parametrize(("labels", "shapes", "kind"), [
    (("aten::mm", "tidal::lm_head", "aten::linear"), ((8, 4),), "logprob / LM-head pass"),
    (("aten::mm", RECOMPUTE, "autograd::engine::evaluate_function: MmBackward0"), (), "recomputation (checkpoint)"),
    (("aten::add_", "Optimizer.step#AdamW.step"), (), "optimizer"),
    (("aten::bmm", ATTENTION), (), "attention forward"),
    (("aten::_scaled_dot_product_flash_attention_for_cpu_backward",
      "autograd::engine::evaluate_function: ScaledDotProductFlashAttentionForCpuBackward0"), (), "attention backward"),
    (("triton_tem_fused_0", "CompiledFunctionBackward", "autograd::engine::evaluate_function: "
      "CompiledFunctionBackward"), (), "attention backward"),
    (("sm90_xmma_gemm_bf16bf16_bf16f32", "aten::mm"), ((16384, 2560), (2560, 16)), "LoRA matmuls"),
    (("nvjet_tst_128x256_64x4_2x1_v_bz_TNN", "aten::mm"), ((16384, 2560), (2560, 9728)), "base matmuls"),
    (("triton_poi_fused_mul_silu_0",), (), "norms, activations, RoPE, other elementwise"),
])
def test_each_rule_gives_its_row(labels, shapes, kind):
    assert classify(Span(0, 1, labels, shapes), lora_rank=16) == kind


def test_with_compiled_layers_a_compiled_backward_is_not_taken_for_attention():
    span = Span(0, 1, ("triton_poi_fused_0", "CompiledFunctionBackward"))
    assert classify(span, 16, compiled_layers=True) == "norms, activations, RoPE, other elementwise"


@pytest.fixture
def one_thread():
    """One torch thread: on a loaded CI machine two spinning OpenMP threads make this tiny step 20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_profiled_cpu_step_fills_every_row_and_adds_up_to_its_wall_time(one_thread):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tidal.config.train import TrainConfig
    from tidal.trainer.grpo import train_step
    from tidal.trainer.model.attention import register
    from tidal.trainer.model.load import prepare_policy
    from tidal.trainer.step.optim import make_optimizer
    from tidal.transport.batch import TrainingBatch

    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                       attn_implementation=register())
    cfg = TrainConfig(model="unused", lora_rank=8, lora_alpha=16, sequence_len=96, per_device_train_batch_size=1,
                      logprob_chunk_size=32, device="cpu", gradient_checkpointing=True)
    model = prepare_policy(LlamaForCausalLM(conf), cfg, torch.device("cpu"))
    opt = make_optimizer(model, cfg)
    rng = np.random.default_rng(0)
    lengths = np.array([40, 40, 16])
    mask = np.concatenate([np.r_[np.zeros(n // 4), np.ones(n - n // 4)] for n in lengths])
    batch = TrainingBatch(step=1, temperature=1.0, tokens=rng.integers(3, 96, size=96), lengths=lengths,
                          loss_mask=mask, inference_logprobs=-rng.random(96), advantages=np.repeat(rng.normal(size=3),
                                                                                                  lengths),
                          rewards=rng.random(3), policy_steps=np.zeros(3), truncated=np.zeros(3, dtype=bool))

    def step() -> None:
        train_step(model, opt, batch, cfg, torch.device("cpu"), pad_id=0)

    step()  # warm-up
    start = time.perf_counter()
    events = list(profile_steps(step, 1, cuda=False))
    outside = time.perf_counter() - start
    result = breakdown(events, cuda=False, lora_rank=8)
    rows = result["rows"]
    assert result["steps"] == 1 and list(rows) == list(KINDS)
    assert all(rows[k] > 0 for k in KINDS), rows
    assert result["wall_s"] <= outside  # the step's range, inside what a clock around the profiler measured
    # each measured against the profiler's raw events by an interval union of its own (no heap, no classify)
    (lo, hi), = [(e.time_range.start, e.time_range.end) for e in events if e.name == STEP]
    assert result["wall_s"] == pytest.approx((hi - lo) / 1e6, rel=1e-9)
    busy = result["wall_s"] - rows[HOST_GAP]
    assert busy == pytest.approx(busy_under(events, lo, hi, lambda names: True), rel=1e-6, abs=1e-9)

    def optimizer(names: list[str]) -> bool:
        return OPTIMIZER in names or any(n.startswith("Optimizer.") for n in names)

    assert rows["optimizer"] == pytest.approx(busy_under(events, lo, hi, optimizer), rel=1e-6)
    assert rows["recomputation (checkpoint)"] == pytest.approx(busy_under(
        events, lo, hi, lambda names: RECOMPUTE in names and not optimizer(names)), rel=1e-6)
    lm_head = [e for e in events if e.name == LM_HEAD]
    frozen = not any(p.requires_grad for p in model.get_output_embeddings().parameters())
    # the chunked logprob Function: its forward and its backward, each in the range; a frozen head's gradient is
    # formed in the forward (tidal.trainer.step.logprobs), so its backward runs no lm_head
    assert frozen and len(lm_head) == 1
    assert rows["logprob / LM-head pass"] == pytest.approx(busy_under(
        events, lo, hi, lambda names: LM_HEAD in names and RECOMPUTE not in names and not optimizer(names)), rel=1e-6)
    table = markdown(result)
    assert len(table) == 2 + len(KINDS) + 1 and all(any(line.startswith(f"| {k} |") for line in table)
                                                     for k in KINDS)


def busy_under(events: list, lo: float, hi: float, keep) -> float:
    """Seconds within [lo, hi] (microseconds) in which some CPU `aten::` op whose ancestry (its name and its
    parents', `keep(names)`) is accepted was running: the union of their intervals, merged after sorting."""
    from torch.autograd import DeviceType

    def names(e) -> list[str]:
        out = []
        while e is not None:
            out.append(str(e.name))
            e = e.cpu_parent
        return out

    intervals = sorted((max(e.time_range.start, lo), min(e.time_range.end, hi)) for e in events
                       if e.device_type == DeviceType.CPU and str(e.name).startswith("aten::")
                       and min(e.time_range.end, hi) > max(e.time_range.start, lo) and keep(names(e)))
    total, end = 0.0, -float("inf")
    for a, b in intervals:
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e6
