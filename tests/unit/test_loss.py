"""GRPO loss vs an independent float64 reference written straight from seed 000's formula."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.config.train import LossConfig
from tidal.trainer.loss import grpo_loss


def reference(lp, inf_lp, adv, mask, seq, cfg: LossConfig, scale):
    """Python-float loops: returns (loss, d loss / d lp as nested lists, masked count, mismatch kl sum)."""
    rows, cols = len(lp), len(lp[0])
    per_seq: dict[int, list[float]] = {}
    for r in range(rows):
        for c in range(cols):
            if mask[r][c] and seq[r][c] >= 0:
                per_seq.setdefault(seq[r][c], []).append(lp[r][c] - inf_lp[r][c])
    seq_ok = {}
    for s, lrs in per_seq.items():
        geo = math.exp(sum(lrs) / len(lrs))
        ratios = [math.exp(x) for x in lrs]
        seq_ok[s] = (cfg.geo_mask_low <= geo <= cfg.geo_mask_high and min(ratios) >= cfg.sequence_mask_low
                     and max(ratios) <= cfg.sequence_mask_high)
    loss, masked, kl = 0.0, 0, 0.0
    grad = [[0.0] * cols for _ in range(rows)]
    for r in range(rows):
        for c in range(cols):
            if not (mask[r][c] and seq[r][c] >= 0):
                continue
            log_ratio = lp[r][c] - inf_lp[r][c]
            ratio = math.exp(log_ratio)
            kl += ratio - 1 - log_ratio
            keep = cfg.token_mask_low <= ratio <= cfg.token_mask_high and seq_ok[seq[r][c]]
            if not keep:
                masked += 1
                continue
            coeff = ratio * (cfg.adv_tau * adv[r][c] - cfg.kl_tau * log_ratio)
            loss += -coeff * lp[r][c] / scale
            grad[r][c] = -coeff / scale
    return loss, grad, masked, kl


def random_case(gen: torch.Generator, rows: int, cols: int, spread: float):
    """Packed rows of uneven samples with prompt (unmasked) and completion (masked) parts and padding."""
    seq = torch.full((rows, cols), -1, dtype=torch.long)
    mask = torch.zeros(rows, cols, dtype=torch.bool)
    adv = torch.zeros(rows, cols, dtype=torch.float64)
    sid = 0
    for r in range(rows):
        at = 0
        while at < cols - 2:
            n = int(torch.randint(2, max(3, cols // 2), (1,), generator=gen))
            n = min(n, cols - at - int(torch.randint(0, 2, (1,), generator=gen)))  # sometimes leave padding
            if n < 2:
                break
            p = int(torch.randint(1, n, (1,), generator=gen))
            seq[r, at:at + n] = sid
            mask[r, at + p:at + n] = True
            adv[r, at:at + n] = torch.randn(1, generator=gen, dtype=torch.float64)
            sid += 1
            at += n
    lp = -torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 3
    inf_lp = lp + torch.randn(rows, cols, generator=gen, dtype=torch.float64) * spread
    return lp, inf_lp, adv, mask, seq


CONFIGS = [
    LossConfig(),
    LossConfig(kl_tau=0.3, adv_tau=0.7),
    LossConfig(kl_tau=0.1, token_mask_low=0.5, token_mask_high=2.0, geo_mask_low=0.7, geo_mask_high=1.4),
    LossConfig(sequence_mask_low=0.3, sequence_mask_high=3.0, kl_tau=0.05),
]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-4)])
@pytest.mark.parametrize("cfg_index", range(len(CONFIGS)))
@pytest.mark.parametrize("trial", range(3))
def test_loss_value_and_gradient_match_float64_reference(dtype, tol, cfg_index, trial):
    cfg = CONFIGS[cfg_index]
    gen = torch.Generator().manual_seed(torch.seed())  # fresh inputs every run
    lp64, inf64, adv64, mask, seq = random_case(gen, rows=3, cols=40, spread=[0.05, 0.6, 1.5][trial])
    scale = float(mask.sum()) + 3.0
    ref_loss, ref_grad, ref_masked, ref_kl = reference(lp64.tolist(), inf64.tolist(), adv64.tolist(),
                                                       mask.tolist(), seq.tolist(), cfg, scale)
    lp = lp64.to(dtype).requires_grad_(True)
    loss, sums = grpo_loss(lp, inf64.to(dtype), adv64.to(dtype), mask, seq, cfg, scale)
    loss.backward()
    grad = torch.tensor(ref_grad, dtype=torch.float64)
    assert abs(loss.item() - ref_loss) <= tol * max(1.0, abs(ref_loss))
    assert torch.allclose(lp.grad.double(), grad, rtol=tol, atol=tol * grad.abs().max().clamp(min=1e-12).item())
    assert sums.masked == ref_masked
    assert sums.tokens == int(mask.sum())
    assert sums.mismatch_kl == pytest.approx(ref_kl, rel=tol, abs=1e-9)


def test_on_policy_gradient_is_minus_advantage_over_scale():
    """When trainer == inference (ratio 1), grad = -A / loss_scale on every loss token, 0 elsewhere."""
    lp = torch.tensor([[-1.0, -2.0, -0.5, -0.1]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[0.0, 0.5, 0.5, 0.5]], dtype=torch.float64)
    mask = torch.tensor([[False, True, True, True]])
    seq = torch.zeros(1, 4, dtype=torch.long)
    loss, sums = grpo_loss(lp, lp.detach().clone(), adv, mask, seq, LossConfig(), 3.0)
    loss.backward()
    assert lp.grad.tolist() == [[0.0, -0.5 / 3, -0.5 / 3, -0.5 / 3]]
    assert sums.masked == 0 and sums.mismatch_kl == 0.0


def test_token_outside_ratio_bounds_is_masked_and_gets_no_gradient():
    lp = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    inf = torch.tensor([[-1.0, -1.0 - math.log(9.0), -1.0]], dtype=torch.float64)  # ratio 9 > 8
    mask = torch.ones(1, 3, dtype=torch.bool)
    cfg = LossConfig(geo_mask_high=100.0)
    loss, sums = grpo_loss(lp, inf, torch.ones(1, 3, dtype=torch.float64), mask, torch.zeros(1, 3, dtype=torch.long),
                           cfg, 3.0)
    loss.backward()
    assert sums.masked == 1 and sums.masked_token == 1
    assert lp.grad[0, 1] == 0.0 and lp.grad[0, 0] != 0.0
