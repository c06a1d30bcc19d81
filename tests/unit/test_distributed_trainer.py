"""Data-parallel trainer ranks and mini-batches (issue: scale-out).

- `tidal.trainer.step.schedule`: optimizer steps of a batch, token-balanced rank assignment, padding slots.
- Dynamic batching (`micro_batch_tokens`): micro-batches within a padded-token budget.
- Real torch.distributed: 2 gloo CPU ranks under `torchrun` (FSDP2, each `zero_level`) train the same step as
  1 rank with the same micro-batches per optimizer step: parameters equal within 1e-5 after several optimizer
  steps (tests/unit/dist_worker.py; SGD there, because AdamW's first step is lr * sign(g) and turns summation
  noise in near-zero gradients into lr-sized differences; AdamW is element-wise and sharded alike).
- `gradient_accumulation_steps: 1` gives one optimizer step per micro-batch and equals a hand-rolled loop;
  `steps_per_generation` splits the batch into that many optimizer steps; each optimizer step takes its own
  point of the LR schedule.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.unit.dist_worker import config, fixed_batch
from tidal.models.sources import resolve_model
from tidal.trainer.step.packing import group_rows, pack
from tidal.trainer.step.schedule import optimizer_groups, plan

WORKER = Path(__file__).with_name("dist_worker.py")


def test_optimizer_groups_follow_accumulation_and_ranks():
    assert optimizer_groups(9, world=1, accumulation=4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert optimizer_groups(9, world=2, accumulation=4) == [list(range(8)), [8]]
    assert optimizer_groups(3, world=1, accumulation=4) == [[0, 1, 2]]
    assert optimizer_groups(7, world=1, accumulation=1, steps_per_generation=3) == [[0, 1], [2, 3, 4], [5, 6]]
    assert optimizer_groups(2, world=1, accumulation=4, steps_per_generation=5) == [[0], [1]]
    assert optimizer_groups(0, world=2, accumulation=1) == []


def test_plan_balances_work_and_pads_to_equal_slots():
    rng = np.random.default_rng(0)
    for _ in range(50):
        work = list(rng.integers(10, 500, rng.integers(1, 12)))
        world = int(rng.integers(1, 4))
        for st in plan(work, world, accumulation=int(rng.integers(1, 5))):
            assert len({len(s) for s in st.slots}) == 1, "every rank runs as many passes"
            real = sorted(i for s, r in zip(st.slots, st.real, strict=True) for i, ok in zip(s, r, strict=True) if ok)
            assert real == st.micro, "each micro-batch trained exactly once"
            for s, r in zip(st.slots, st.real, strict=True):
                kept = [i for i, ok in zip(s, r, strict=True) if ok]
                assert kept == sorted(kept), "a rank runs its share in batch order"
                assert all(i in st.micro for i in s), "padding copies a micro-batch of the same step"
            loads = [sum(work[i] for i, ok in zip(s, r, strict=True) if ok) for s, r in zip(st.slots, st.real,
                                                                                          strict=True)]
            assert max(loads) - min(loads) <= max(work[i] for i in st.micro), "greedy balance bound"


def test_token_budget_micro_batches():
    rows = [60, 60, 50, 30, 30, 20, 10]
    groups = group_rows(rows, rows_per_micro_batch=2, max_tokens=128)
    assert sorted(r for g in groups for r in g) == list(range(len(rows)))
    for g in groups:
        assert len(g) == 1 or len(g) * max(rows[r] for r in g) <= 128
    assert groups == [[0, 1], [2, 3], [4, 5, 6]]  # 2x60; 2x50 (a third row makes 3x50 > 128); 3x30
    assert group_rows(rows, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    batch = fixed_batch()
    micro = pack(batch, 40, 1, max_tokens=80)
    assert all(mb.input_ids.numel() <= 80 for mb in micro)
    assert sum(mb.num_tokens for mb in micro) == int(batch.lengths.sum())


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one_rank")
    subprocess.run([sys.executable, str(WORKER), str(out), "1", "8,2"], check=True, capture_output=True, timeout=300)
    return out


def _torchrun(out: Path, *args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKER), str(out), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("zero_level", [1, *(pytest.param(z, marks=pytest.mark.slow) for z in (2, 3))])
def test_two_gloo_ranks_train_like_one_rank(tmp_path, one_rank, zero_level):
    _torchrun(tmp_path, str(zero_level), "4,1")
    for single, double in (("8", "4"), ("2", "1")):  # the same micro-batches per optimizer step
        a = load_file(str(one_rank / f"params_acc{single}.safetensors"))
        b = load_file(str(tmp_path / f"params_acc{double}.safetensors"))
        assert a.keys() == b.keys() and len(a) == 56
        assert max(float(v.abs().max()) for k, v in a.items() if "lora_B" in k) > 1e-3, "training moved B"
        worst = max(float((a[k] - b[k]).abs().max()) for k in a)
        assert worst < 1e-5, (zero_level, single, worst)
        ma = json.loads((one_rank / f"metrics_acc{single}.json").read_text())
        mb = json.loads((tmp_path / f"metrics_acc{double}.json").read_text())
        assert ma["optim/steps"] == mb["optim/steps"] > 1, "several optimizer steps per batch"
        for key in ("loss", "grad_norm", "tokens", "mismatch_kl", "entropy", "clip_ratio/low_min",
                    "clip_ratio/high_max", "kl"):
            assert mb[key] == pytest.approx(ma[key], rel=1e-5, abs=1e-7), key


@pytest.mark.slow
def test_two_gloo_ranks_fully_fine_tune_like_one_rank(tmp_path):
    """`lora: false` across ranks (zero_level 3: every weight, tied embeddings included, sharded): the same
    trained weights as one rank; beta > 0 exercises the frozen reference copy on each rank."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    subprocess.run([sys.executable, str(WORKER), str(one), "1", "2", "grpo", "full"], check=True,
                   capture_output=True, timeout=300)
    _torchrun(two, "3", "1", "grpo", "full")
    a, b = load_file(str(one / "params_acc2.safetensors")), load_file(str(two / "params_acc1.safetensors"))
    assert a.keys() == b.keys() and "model.embed_tokens.weight" in a and not any("lora" in k for k in a)
    base = load_file(str(Path(resolve_model("tidal:tiny-reverse")) / "model.safetensors"))
    assert max(float((a[k] - base[k]).abs().max()) for k in a) > 1e-3, "training moved the weights"
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 1e-5, worst


@pytest.mark.parametrize("loss_type", ["aipo", "grpo", "bnpo", "dr_grpo", "dapo"])
def test_accumulation_one_is_an_optimizer_step_per_micro_batch(loss_type):
    """Each optimizer step normalizes its loss over its own micro-batch, per the loss type's definition."""
    from tidal.trainer.grpo import train_step
    from tidal.trainer.policy import build_policy
    from tidal.trainer.step.logprobs import forward_logprobs, forward_logprobs_entropy
    from tidal.trainer.step.loss import LossInputs, LossScale, policy_loss

    cfg = config(1, 1, 1, loss_type).model_copy(update={"learning_rate": 5e-3})
    batch = fixed_batch()
    p, hand = build_policy(cfg, None), build_policy(cfg, None)
    m = train_step(p.model, p.opt, batch, cfg, p.device, p.pad_id, sched=p.sched)
    micro = pack(batch, cfg.sequence_len, cfg.per_device_train_batch_size, hand.pad_id)
    assert m["micro_batches"] == len(micro) >= 4 and m["optim/steps"] == len(micro)

    model, opt = hand.model, hand.opt  # by hand: the old policy is the model before the first update
    with torch.no_grad():
        old = [forward_logprobs(model, mb.input_ids, mb.position_ids, loss_mask=mb.loss_mask) for mb in micro]
        with model.disable_adapter():
            ref = [forward_logprobs(model, mb.input_ids, mb.position_ids, loss_mask=mb.loss_mask) if cfg.loss.beta
                   else None for mb in micro]
    for mb, o, r in zip(micro, old, ref, strict=True):
        lp, ent = forward_logprobs_entropy(model, mb.input_ids, mb.position_ids, loss_mask=mb.loss_mask)
        scale = LossScale(step_tokens=float(mb.loss_mask.sum()), step_sequences=int(mb.seq_ids.unique().ge(0).sum()),
                          micro_batches=1, max_completion_len=batch.max_tokens)
        loss, _ = policy_loss(LossInputs(lp, o, mb.inference_logprobs, mb.advantages, mb.loss_mask, mb.seq_ids,
                                         ref_logprobs=r, entropy=ent), cfg.loss, scale)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([q for q in model.parameters() if q.requires_grad], cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    trained = dict(p.model.named_parameters())
    for name, q in model.named_parameters():
        if q.requires_grad:
            torch.testing.assert_close(trained[name], q, rtol=0, atol=1e-6, msg=name)
    assert int(next(iter(p.opt.state.values()))["step"]) == len(micro)


def test_steps_per_generation_and_lr_per_optimizer_step():
    from tidal.trainer.grpo import train_step
    from tidal.trainer.policy import build_policy

    cfg = config(1, 1, 4, "aipo").model_copy(update={"steps_per_generation": 3, "learning_rate": 1e-3,
                                                     "lr_scheduler_type": "linear", "warmup_steps": 0})
    p = build_policy(cfg, 4)
    seen: list[float] = []
    p.opt.register_step_pre_hook(lambda opt, *_: seen.append(opt.param_groups[0]["lr"]))
    for step in (1, 2):
        m = train_step(p.model, p.opt, fixed_batch(step), cfg, p.device, p.pad_id, sched=p.sched)
        assert m["optim/steps"] == 3
        p.sched.step()
    expected = [1e-3 * (1 - (s + k / 3) / 4) for s in (0, 1) for k in range(3)]
    assert seen == pytest.approx(expected, rel=1e-12), "each optimizer step at its own point of the schedule"
