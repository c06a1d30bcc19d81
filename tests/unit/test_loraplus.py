"""train `loraplus_lr_ratio` (LoRA+, `tidal.trainer.step.optim.loraplus`): the A matrices learn at `learning_rate`,
the B matrices at `learning_rate x ratio`; checked on PEFT policies of two architectures built from configs (random
init): the groups, every parameter's update against a float64 numpy AdamW at its group's rate over fresh random
gradients, the schedule scaling both groups, a name-keyed checkpoint (the trainer's state files) resuming the same
update, bitsandbytes' 8-bit AdamW taking the same groups, the trainer's own policy builder using them, and the key
refused where it cannot apply."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tidal.config.train import TrainConfig
from tidal.trainer import distributed as dist
from tidal.trainer.grpo import _set_lr
from tidal.trainer.state import load_state, save_state
from tidal.trainer.step.optim import lr_factor, make_optimizer, make_scheduler

LR, RATIO, WD = 1e-3, 16.0, 0.05
ARCHS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                                  num_hidden_layers=2, num_attention_heads=4,
                                                  num_key_value_heads=2)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48,
                                                  num_hidden_layers=2, num_attention_heads=4,
                                                  num_key_value_heads=2)),
}


def policy(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A LoRA (r 4, all linear layers) policy on a random `arch` model; B drawn non-zero so A has gradients too."""
    torch.manual_seed(seed)
    model = get_peft_model(ARCHS[arch]().to(dtype), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def config(**keys: object) -> TrainConfig:
    return TrainConfig(model="unused", learning_rate=LR, weight_decay=WD, **keys)  # type: ignore[arg-type]


def names(model: torch.nn.Module, group: dict) -> list[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for p in group["params"]]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_and_b_matrices_get_their_own_rates(arch):
    model = policy(arch)
    opt = make_optimizer(model, config(loraplus_lr_ratio=RATIO))
    assert len(opt.param_groups) == 2, "empty groups (no LoRA embedding, no 1-D tensor) are dropped"
    a, b = (names(model, g) for g in opt.param_groups)
    assert a and all("lora_A" in n for n in a) and opt.param_groups[0]["lr"] == LR
    assert b and all("lora_B" in n for n in b) and opt.param_groups[1]["lr"] == pytest.approx(LR * RATIO)
    assert all(g["weight_decay"] == WD for g in opt.param_groups)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert sorted(a + b) == trainable
    plain = make_optimizer(policy(arch), config())
    assert len(plain.param_groups) == 1 and plain.param_groups[0]["lr"] == LR


def adamw_reference(p0: np.ndarray, grads: list[np.ndarray], lr: float) -> np.ndarray:
    """AdamW in float64 numpy as its paper and torch's docs write it (decoupled decay, bias corrections)."""
    p, m, v = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)
    b1, b2, eps = 0.9, 0.999, 1e-8
    for t, g in enumerate(grads, start=1):
        p = p * (1 - lr * WD)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr / (1 - b1**t) * m / (np.sqrt(v / (1 - b2**t)) + eps)
    return p


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_parameter_moves_as_float64_adamw_at_its_groups_rate(arch):
    model = policy(arch, seed=1, dtype=torch.float64)
    opt = make_optimizer(model, config(loraplus_lr_ratio=RATIO))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    start = {n: p.detach().numpy().copy() for n, p in params.items()}
    gen = torch.Generator().manual_seed(7)
    grads: dict[str, list[np.ndarray]] = {n: [] for n in params}
    for _ in range(3):
        for n, p in params.items():
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            grads[n].append(p.grad.numpy().copy())
        opt.step()
    moved_b = []
    for n, p in params.items():
        lr = LR * RATIO if "lora_B" in n else LR
        np.testing.assert_allclose(p.detach().numpy(), adamw_reference(start[n], grads[n], lr),
                                   rtol=1e-12, atol=1e-15, err_msg=n)
        if "lora_B" in n:
            moved_b.append(np.abs(p.detach().numpy() - start[n]).max())
    assert min(moved_b) > 3 * LR, "B moved at A's rate: the ratio had no effect"


def test_the_schedule_scales_both_groups():
    model = policy("llama")
    opt = make_optimizer(model, config(loraplus_lr_ratio=RATIO))
    sched = make_scheduler(opt, "linear", warmup_steps=2, total_steps=10)
    for step in range(8):
        sched.last_epoch = step
        for offset in (0.0, 0.5):
            _set_lr(opt, sched, offset)
            factor = lr_factor(step + offset, "linear", 2, 10)
            assert opt.param_groups[0]["lr"] == pytest.approx(LR * factor)
            assert opt.param_groups[1]["lr"] == pytest.approx(LR * RATIO * factor)


def test_a_checkpointed_state_resumes_the_same_update(tmp_path):
    def run(model: torch.nn.Module, opt: torch.optim.Optimizer, seeds: range) -> None:
        for s in seeds:
            gen = torch.Generator().manual_seed(s)
            for p in (q for q in model.parameters() if q.requires_grad):
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()

    cfg = config(loraplus_lr_ratio=RATIO)
    a = policy("qwen2")
    a_opt = make_optimizer(a, cfg)
    run(a, a_opt, range(2))
    state = dist.optimizer_state(dist.SINGLE, a, a_opt)
    assert state is not None and len(state["param_groups"]) == 2
    save_state(tmp_path, "optimizer", state)  # the trainer's checkpoint files (no pickle)
    saved = load_state(tmp_path, "optimizer")
    b = policy("qwen2", seed=3)  # other weights: the trainable ones come from a
    b.load_state_dict(a.state_dict())
    b_opt = make_optimizer(b, cfg)
    dist.load_optimizer_state(dist.SINGLE, b, b_opt, saved)
    assert [g["lr"] for g in b_opt.param_groups] == [g["lr"] for g in a_opt.param_groups]
    run(a, a_opt, range(2, 4))
    run(b, b_opt, range(2, 4))
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_8bit_adamw_takes_the_same_groups():
    model = policy("llama")
    opt = make_optimizer(model, config(loraplus_lr_ratio=RATIO, optimizer="adamw_8bit"))
    assert type(opt).__name__ == "AdamW8bit"
    a, b = (names(model, g) for g in opt.param_groups)
    assert all("lora_A" in n for n in a) and all("lora_B" in n for n in b)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([LR, LR * RATIO])
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    for p in (q for q in model.parameters() if q.requires_grad):
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.requires_grad)


def test_the_key_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="loraplus_lr_ratio .*needs lora: true"):
        TrainConfig(model="m", lora=False, loraplus_lr_ratio=16)
    with pytest.raises(ValueError, match="loraplus_lr_ratio"):
        TrainConfig(model="m", loraplus_lr_ratio=0.5)  # B slower than A is not LoRA+


def test_the_trainers_policy_trains_with_the_two_rates():
    """`build_policy` (what `tidal grpo-train` and the pool's forked trainer call) on the bundled model, then one
    training step: Adam's first step moves each element by ~its rate, so the B matrices (zero at the start) move by
    up to `learning_rate x ratio`, and the A matrices not at all (a zero B gives them no gradient)."""
    from tests.unit.dist_worker import config as dist_config
    from tests.unit.dist_worker import fixed_batch
    from tidal.trainer.grpo import train_step
    from tidal.trainer.policy import build_policy

    cfg = dist_config(1, 1, 16, "dapo").model_copy(update={"learning_rate": 1e-3, "loraplus_lr_ratio": 8.0})
    p = build_policy(cfg, 10)
    assert [g["lr"] for g in p.opt.param_groups] == pytest.approx([1e-3, 8e-3])
    before = {n: q.detach().clone() for n, q in p.model.named_parameters() if q.requires_grad}
    train_step(p.model, p.opt, fixed_batch(), cfg, p.device, p.pad_id, sched=p.sched)
    moved = {n: float((q.detach() - before[n]).abs().max()) for n, q in p.model.named_parameters() if n in before}
    b = [v for n, v in moved.items() if "lora_B" in n]
    a = [v for n, v in moved.items() if "lora_A" in n]
    assert b and a and len(a) + len(b) == len(moved)
    assert all(v == pytest.approx(8e-3, rel=1e-3) for v in b)
    assert max(a) == 0.0


def test_two_gloo_ranks_train_the_two_groups(tmp_path):
    """The same on two torch.distributed ranks (gloo, FSDP2-sharded LoRA parameters, tests/unit/dist_worker.py): each
    rank's optimizer has both groups at their rates, and after one optimizer step every B moved by up to `lr x
    ratio` and every A is still its initial value (the one-rank policy builder's, the same seed)."""
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from tests.unit.dist_worker import config as dist_config
    from tidal.trainer.policy import build_policy

    worker = Path(__file__).with_name("dist_worker.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(worker), str(tmp_path), "1", "8", "dapo", "loraplus"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"lrs_rank{rank}.json").read_text()) == pytest.approx([1e-3, 8e-3])
    after = load_file(str(tmp_path / "params_acc8.safetensors"))
    start = build_policy(dist_config(1, 1, 16, "dapo").model_copy(update={"learning_rate": 1e-3,
                                                                          "loraplus_lr_ratio": 8.0}), 10)
    initial = {n: q.detach() for n, q in start.model.named_parameters() if q.requires_grad}
    assert after.keys() == initial.keys()
    assert all(float(v.abs().max()) == pytest.approx(8e-3, rel=1e-3) for k, v in after.items() if "lora_B" in k)
    assert all(torch.equal(v, initial[k]) for k, v in after.items() if "lora_A" in k)
