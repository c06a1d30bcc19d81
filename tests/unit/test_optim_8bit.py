"""train `optimizer: adamw_8bit` (bitsandbytes' blockwise 8-bit AdamW, CPU backend here): the moments really are
stored in 8 bits, the optimizer tracks torch's AdamW on a small regression within a stated tolerance, and a
checkpoint (the trainer's pickle-free state files, then a LoRA policy through `save_trainer`/`load_trainer`)
resumes it bit-exactly."""

from __future__ import annotations

import pytest
import torch

from tidal.config.train import TrainConfig
from tidal.models.sources import resolve_model
from tidal.trainer.state import load_state, save_state
from tidal.trainer.step.optim import MIN_8BIT_SIZE, make_optimizer

STEPS = 200
LOSS_RTOL = 0.05
"""Final-loss tolerance, relative, vs torch AdamW (measured: 1.1% at 200 steps)."""
WEIGHT_RTOL = 0.03
"""Tolerance on ||W_8bit - W_adamw|| / ||W_adamw|| after `STEPS` steps (measured: 0.7%)."""


def regression(optimizer: str) -> tuple[torch.nn.Linear, list[float], torch.optim.Optimizer]:
    """`STEPS` full-batch steps of least squares y = x W + noise (noise variance 0.01) from a fixed init."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=gen)
    y = x @ (torch.randn(128, 64, generator=gen) / 128**0.5) + 0.1 * torch.randn(512, 64, generator=gen)
    torch.manual_seed(1)
    lin = torch.nn.Linear(128, 64)  # weight: 8192 elements (8-bit state); bias: 64 (float32 state)
    cfg = TrainConfig(model="unused", optimizer=optimizer, learning_rate=3e-3, weight_decay=0.01)
    opt = make_optimizer(lin, cfg)
    losses = []
    for _ in range(STEPS):
        loss = (lin(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return lin, losses, opt


def test_adamw_8bit_stores_8bit_moments_and_tracks_adamw():
    ref, ref_losses, ref_opt = regression("adamw")
    q, q_losses, q_opt = regression("adamw_8bit")
    assert type(ref_opt) is torch.optim.AdamW and type(q_opt).__name__ == "AdamW8bit"
    state = q_opt.state[q.weight]
    assert q.weight.numel() >= MIN_8BIT_SIZE > q.bias.numel()
    assert state["state1"].dtype == torch.uint8 and state["state2"].dtype == torch.uint8
    assert state["state1"].shape == q.weight.shape and state["absmax1"].numel() == q.weight.numel() // 256
    assert q_opt.state[q.bias]["state1"].dtype == torch.float32  # small tensors keep 32-bit moments
    assert ref_losses[-1] < 0.02 < ref_losses[0] / 50, "the problem must be solved, to compare the paths"
    assert q_losses[-1] == pytest.approx(ref_losses[-1], rel=LOSS_RTOL)
    rel = float((q.weight - ref.weight).detach().norm() / ref.weight.detach().norm())
    assert rel < WEIGHT_RTOL
    assert rel > 1e-5, "bit-identical to AdamW: the moments were not quantized"


def test_adamw_8bit_state_resumes_bit_exactly_through_state_files(tmp_path):
    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        # two weights of 6144 elements (8-bit moments sharing one pair of quantization maps), biases 32-bit
        return torch.nn.Sequential(torch.nn.Linear(96, 64), torch.nn.Tanh(), torch.nn.Linear(64, 96))

    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(16, 96, generator=gen) for _ in range(5)]
    cfg = TrainConfig(model="unused", optimizer="adamw_8bit", learning_rate=1e-2, weight_decay=0.1)

    def step(m: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()

    a = model(0)
    a_opt = make_optimizer(a, cfg)
    for x in xs[:3]:
        step(a, a_opt, x)
    save_state(tmp_path, "s", {"optimizer": a_opt.state_dict(), "model": a.state_dict()})
    state = load_state(tmp_path, "s")
    b = model(1)  # different init: everything must come from the files
    b.load_state_dict(state["model"])
    b_opt = make_optimizer(b, cfg)
    b_opt.load_state_dict(state["optimizer"])
    for x in xs[3:]:
        step(a, a_opt, x)
        step(b, b_opt, x)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
        sa, sb = a_opt.state[p], b_opt.state[q]
        assert sa.keys() == sb.keys() and sa["step"] == sb["step"] == 5
        for key in sa:
            if isinstance(sa[key], torch.Tensor):
                assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key
    assert b_opt.state[b[0].weight]["state1"].dtype == b_opt.state[b[2].weight]["state1"].dtype == torch.uint8
    assert b_opt.state[b[0].bias]["state1"].dtype == torch.float32


def test_trainer_checkpoint_resumes_adamw_8bit_lora_policy_exactly(tmp_path):
    """The trainer's own checkpoint path (name-keyed optimizer state, `save_trainer` / `load_trainer`) on the
    bundled model, LoRA rank 16: factors of >= 4096 elements get 8-bit moments, the k/v B factors (128 x 16)
    float32 ones; both kinds resume exactly."""
    from tidal.config.train import TrainCkptSection
    from tidal.trainer import distributed as dist
    from tidal.trainer.ckpt import load_trainer, save_trainer
    from tidal.trainer.model.load import load_policy
    from tidal.trainer.step.optim import make_scheduler

    cfg = TrainConfig(model=resolve_model("tidal:tiny-reverse"), device="cpu", optimizer="adamw_8bit",
                      learning_rate=1e-2, lora_rank=16, lora_alpha=32)
    gen = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, 128, (2, 24), generator=gen) for _ in range(4)]

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        model, _ = load_policy(cfg)
        opt = make_optimizer(model, cfg)
        return model, opt, make_scheduler(opt, "constant", 1, None)

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
             x: torch.Tensor) -> None:
        opt.zero_grad()
        model(input_ids=x).logits.float().logsumexp(-1).mean().backward()
        opt.step()
        sched.step()

    model, opt, sched = build()
    for x in ids[:2]:
        step(model, opt, sched, x)
    kinds = [s["state1"].dtype for s in opt.state.values()]
    assert kinds.count(torch.uint8) == 6 * 4 * 2 and kinds.count(torch.float32) == 2 * 4  # k/v B: 32-bit
    save_trainer(tmp_path, 2, model, dist.optimizer_state(dist.SINGLE, model, opt), sched, TrainCkptSection())
    model2, opt2, sched2 = build()
    state = load_trainer(tmp_path, 2, model2, sched2)
    dist.load_optimizer_state(dist.SINGLE, model2, opt2, state["optimizer"])
    for x in ids[2:]:
        step(model, opt, sched, x)
        step(model2, opt2, sched2, x)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    resumed = {n: p for n, p in model2.named_parameters() if p.requires_grad}
    assert trained.keys() == resumed.keys()
    for name, p in trained.items():
        assert torch.equal(p, resumed[name]), name


def test_adamw_8bit_is_refused_with_several_ranks(tmp_path):
    """bitsandbytes' kernels reject FSDP2's DTensor parameters (checked with gloo ranks), so the config says so."""
    from tidal.config import ConfigError, load_config

    path = tmp_path / "train.yaml"
    path.write_text("model: m\noptimizer: adamw_8bit\ngpus: 2\n")
    with pytest.raises(ConfigError, match=r"optimizer 'adamw_8bit' works with gpus: 1 only \(got 2\)"):
        load_config(TrainConfig, path)
    assert TrainConfig(model="m", optimizer="adamw", gpus=2).gpus == 2
    assert TrainConfig(model="m", optimizer="adamw_8bit", gpus=1).optimizer == "adamw_8bit"
