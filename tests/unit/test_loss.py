"""Every policy-loss variant vs an independent float64 reference written from the formulas in
docs/algorithms.md: per-token Python loops over scalars (autograd through scalar ops gives the reference
gradient), on fresh random packed inputs with prompt/completion masks, padding and uneven lengths."""

from __future__ import annotations

import math

import pytest
import torch

from tidal.config.train import LossConfig
from tidal.trainer.step.loss import LossInputs, LossScale, policy_loss


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default), written out."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def reference(case: dict, cfg: LossConfig, scale: LossScale) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Loss, d loss / d lp (B, T) and a few metric sums, token by token."""
    lp_t = case["lp"].detach().clone().requires_grad_(True)
    rows, cols = lp_t.shape
    toks = [(r, c) for r in range(rows) for c in range(cols) if case["mask"][r, c] and case["seq"][r, c] >= 0]
    by_seq: dict[int, list[tuple[int, int]]] = {}
    for r, c in toks:
        by_seq.setdefault(int(case["seq"][r, c]), []).append((r, c))
    lp = {t: lp_t[t] for t in toks}
    f = {k: {t: float(case[k][t]) for t in toks} for k in ("old", "inf", "adv", "ref", "teacher", "ent")}

    def m(t):  # detached log ratio trainer / inference
        return float(lp[t].detach()) - f["inf"][t]

    seq_ok = {}
    for s, ts in by_seq.items():
        ratios = [math.exp(m(t)) for t in ts]
        geo = math.exp(sum(m(t) for t in ts) / len(ts))
        seq_ok[s] = (cfg.geo_mask_low <= geo <= cfg.geo_mask_high and min(ratios) >= cfg.sequence_mask_low
                     and max(ratios) <= cfg.sequence_mask_high)
    keep = {t: cfg.token_mask_low <= math.exp(m(t)) <= cfg.token_mask_high and seq_ok[int(case["seq"][t])]
            for t in toks}
    thr = quantile([f["ent"][t] for t in toks], 1 - cfg.top_entropy_quantile)
    ent_ok = {t: cfg.top_entropy_quantile >= 1 or f["ent"][t] >= thr for t in toks}
    eps_hi = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    sums = {"clip_low": 0, "clip_high": 0, "masked": 0}
    loss_tok = {}
    for ts in by_seq.values():
        seq_log_r = sum(lp[t] - f["old"][t] for t in ts) / len(ts)
        geo = math.exp(sum(m(t) for t in ts) / len(ts))
        for t in ts:
            a = cfg.adv_tau * f["adv"][t] + cfg.teacher_tau * (f["teacher"][t] - float(lp[t].detach()))
            pk = keep[t] and ent_ok[t]
            if cfg.loss_type == "aipo":
                w = math.exp(m(t)) if cfg.ratio_type == "token" else min(geo, cfg.sequence_clip_high)
                sums["clip_high"] += cfg.ratio_type == "sequence" and geo > cfg.sequence_clip_high
                obj = w * (a - cfg.kl_tau * m(t)) * lp[t]
            else:
                log_r = seq_log_r if cfg.importance_sampling_level == "sequence" else lp[t] - f["old"][t]
                r = torch.exp(log_r)
                c1 = r if cfg.delta is None or float(r) <= cfg.delta else r.detach() * 0 + cfg.delta
                c2 = r if 1 - cfg.epsilon <= float(r) <= 1 + eps_hi else (
                    r.detach() * 0 + min(max(float(r), 1 - cfg.epsilon), 1 + eps_hi))
                obj = c1 * a if float(c1) * a <= float(c2) * a else c2 * a
                if cfg.ratio_clip_c is not None and a < 0 and float(obj) < cfg.ratio_clip_c * a:
                    obj = obj.detach() * 0 + cfg.ratio_clip_c * a
                sums["clip_low"] += float(r) < 1 - cfg.epsilon and a < 0
                sums["clip_high"] += float(r) > 1 + eps_hi and a > 0
                w_is = math.exp(f["old"][t] - f["inf"][t])
                if cfg.is_correction == "truncated":
                    w_is = min(w_is, cfg.is_cap)
                if cfg.is_correction == "masked" and w_is > cfg.is_cap:
                    pk = False
                if cfg.is_correction != "none":
                    obj = obj * w_is
            val = -obj if pk else lp[t] * 0
            if cfg.beta and keep[t]:
                d = f["ref"][t] - lp[t]
                kl = torch.exp(d) - d - 1
                if cfg.use_on_policy_kl_approximation:
                    kl = kl * math.exp(float(lp[t]) - f["old"][t])
                val = val + cfg.beta * kl
            sums["masked"] += not pk
            loss_tok[t] = val
    if cfg.loss_type in ("aipo", "dapo"):
        loss = sum(loss_tok.values()) / scale.step_tokens
    elif cfg.loss_type == "bnpo":
        loss = sum(loss_tok.values()) / len(toks) / scale.micro_batches
    elif cfg.loss_type == "dr_grpo":
        loss = sum(loss_tok.values()) / (scale.step_sequences * scale.max_completion_len)
    else:
        loss = sum(sum(loss_tok[t] for t in ts) / len(ts) for ts in by_seq.values()) / scale.step_sequences
    loss.backward()
    return loss.detach(), lp_t.grad, sums


def random_case(gen: torch.Generator, rows: int, cols: int, spread: float, drift: float) -> dict:
    """Packed rows of uneven samples: prompt (unmasked) and completion (masked) parts, some padding."""
    seq = torch.full((rows, cols), -1, dtype=torch.long)
    mask = torch.zeros(rows, cols, dtype=torch.bool)
    adv = torch.zeros(rows, cols, dtype=torch.float64)
    sid = 0
    for r in range(rows):
        at = 0
        while at < cols - 2:
            n = int(torch.randint(2, max(3, cols // 2), (1,), generator=gen))
            n = min(n, cols - at - int(torch.randint(0, 2, (1,), generator=gen)))
            if n < 2:
                break
            p = int(torch.randint(1, n, (1,), generator=gen))
            seq[r, at:at + n] = sid
            mask[r, at + p:at + n] = True
            adv[r, at:at + n] = torch.randn(1, generator=gen, dtype=torch.float64)
            adv[r, at + p:at + n] += 0.3 * torch.randn(n - p, generator=gen, dtype=torch.float64)  # process-style
            sid += 1
            at += n

    def noise(s: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, dtype=torch.float64) * s

    lp = -torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 3
    return {"lp": lp, "old": lp + noise(drift), "inf": lp + noise(spread), "adv": adv, "mask": mask, "seq": seq,
            "ref": lp + noise(0.3), "teacher": lp + noise(0.5),
            "ent": torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 4}


AIPO = [
    {},
    {"kl_tau": 0.3, "adv_tau": 0.7},
    {"kl_tau": 0.1, "token_mask_low": 0.5, "token_mask_high": 2.0, "geo_mask_low": 0.7, "geo_mask_high": 1.4},
    {"sequence_mask_low": 0.3, "sequence_mask_high": 3.0, "kl_tau": 0.05},
    {"ratio_type": "sequence"},
    {"ratio_type": "sequence", "sequence_clip_high": 1.05, "kl_tau": 0.2},
    {"teacher_tau": 0.4},
    {"beta": 0.2},
    {"beta": 0.1, "use_on_policy_kl_approximation": True, "num_iterations": 2},
    {"top_entropy_quantile": 0.3},
    {"top_entropy_quantile": 0.0},
]
CLIPPED = [
    {},
    {"epsilon": 0.1, "epsilon_high": 0.28},
    {"delta": 1.5},
    {"importance_sampling_level": "sequence"},
    {"ratio_clip_c": 1.5, "epsilon": 0.1},
    {"is_correction": "token"},
    {"is_correction": "truncated", "is_cap": 1.2},
    {"is_correction": "masked", "is_cap": 1.2},
    {"beta": 0.3},
    {"beta": 0.3, "use_on_policy_kl_approximation": True},
    {"top_entropy_quantile": 0.4, "teacher_tau": 0.2, "adv_tau": 1.5},
    {"token_mask_low": 0.6, "token_mask_high": 1.5, "geo_mask_high": 1.3},
]
VARIANTS = ([("aipo", kw) for kw in AIPO]
            + [(lt, kw) for lt in ("grpo", "bnpo", "dr_grpo", "dapo") for kw in CLIPPED])


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-4)])
@pytest.mark.parametrize("loss_type,kw", VARIANTS, ids=[f"{lt}-{'-'.join(kw) or 'default'}" for lt, kw in VARIANTS])
def test_policy_loss_matches_reference(loss_type, kw, dtype, tol):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = LossConfig(loss_type=loss_type, **kw)
    gen = torch.Generator().manual_seed(hash((loss_type, tuple(kw), str(dtype))) % 2**31)
    for spread, drift in ((0.02, 0.05), (0.3, 0.3), (1.5, 0.8)):  # aligned .. far off-policy
        case = random_case(gen, rows=3, cols=40, spread=spread, drift=drift)
        tokens = float((case["mask"] & (case["seq"] >= 0)).sum())
        scale = LossScale(step_tokens=tokens * 1.7, step_sequences=int(case["seq"].max()) + 3, micro_batches=2,
                          max_completion_len=25)
        ref_loss, ref_grad, ref_sums = reference(case, cfg, scale)

        lp = case["lp"].to(dtype).requires_grad_(True)
        inputs = LossInputs(logprobs=lp, **{k: case[v].to(dtype) for k, v in (
            ("old_logprobs", "old"), ("inference_logprobs", "inf"), ("advantages", "adv"), ("ref_logprobs", "ref"),
            ("teacher_logprobs", "teacher"), ("entropy", "ent"))}, loss_mask=case["mask"], seq_ids=case["seq"])
        loss, sums = policy_loss(inputs, cfg, scale)
        loss.backward()
        assert lp.grad is not None
        scale_ref = max(abs(float(ref_loss)), 1e-3)
        assert abs(float(loss) - float(ref_loss)) <= tol * scale_ref, (spread, float(loss), float(ref_loss))
        gmax = max(float(ref_grad.abs().max()), 1e-3)
        assert float((lp.grad.double() - ref_grad).abs().max()) <= tol * gmax, spread
        assert sums["masked"] == ref_sums["masked"]
        assert sums["clip_ratio/low_mean"] == ref_sums["clip_low"]
        assert sums["clip_ratio/high_mean"] == ref_sums["clip_high"]
        assert sums["tokens"] == (case["mask"] & (case["seq"] >= 0)).sum()


def test_first_iteration_gradient_is_the_advantage():
    """With old = lp (first iteration) and matching inference, every clipped type's gradient is -A / norm."""
    gen = torch.Generator().manual_seed(3)
    case = random_case(gen, 2, 30, spread=0.0, drift=0.0)
    lp = case["lp"].clone().requires_grad_(True)
    toks = case["mask"] & (case["seq"] >= 0)
    scale = LossScale(step_tokens=float(toks.sum()), step_sequences=1, micro_batches=1, max_completion_len=1)
    loss, _ = policy_loss(LossInputs(lp, lp.detach(), lp.detach(), case["adv"], case["mask"], case["seq"]),
                          LossConfig(loss_type="dapo"), scale)
    loss.backward()
    assert lp.grad is not None
    assert torch.allclose(lp.grad[toks], -case["adv"][toks] / float(toks.sum()), rtol=1e-12)
    assert torch.all(lp.grad[~toks] == 0)


def test_loss_type_combinations_are_checked():
    with pytest.raises(ValueError, match="loss.epsilon applies to TRL's loss types"):
        LossConfig(epsilon=0.3)
    with pytest.raises(ValueError, match="loss.delta applies to the clipped loss types"):
        LossConfig(loss_type="cispo", delta=3.0)
    with pytest.raises(ValueError, match="sapo_temperature_neg applies to loss_type 'sapo' only"):
        LossConfig(loss_type="grpo", sapo_temperature_neg=2.0)
    with pytest.raises(ValueError, match="vespo folds a token-level correction"):
        LossConfig(loss_type="vespo", is_correction="sequence_masked")
    with pytest.raises(ValueError, match="is_cap_min .* must be below"):
        LossConfig(loss_type="grpo", is_correction="truncated", is_cap=2.0, is_cap_min=2.5)
    with pytest.raises(ValueError, match="entropy_target applies with loss.use_adaptive_entropy"):
        LossConfig(entropy_target=0.5)
    with pytest.raises(ValueError, match="entropy_coef_min .* must not exceed"):
        LossConfig(use_adaptive_entropy=True, entropy_coef_min=0.5, entropy_coef_max=0.1)
    with pytest.raises(ValueError, match="use_bias_correction_kl needs loss.beta"):
        LossConfig(loss_type="grpo", use_bias_correction_kl=True)
    with pytest.raises(ValueError, match="use loss.beta"):
        LossConfig(loss_type="grpo", kl_tau=0.1)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        LossConfig(loss_type="grpo", ratio_type="sequence")
    with pytest.raises(ValueError, match="must exceed 1 \\+ epsilon_high"):
        LossConfig(loss_type="grpo", delta=1.1, epsilon_high=0.28)
    with pytest.raises(ValueError, match="is_cap only applies"):
        LossConfig(loss_type="grpo", is_cap=3)
    with pytest.raises(ValueError, match="needs loss.beta > 0"):
        LossConfig(use_on_policy_kl_approximation=True)
    with pytest.raises(ValueError, match="both weight the KL term by the ratio to the old policy"):
        LossConfig(loss_type="grpo", beta=0.1, use_on_policy_kl_approximation=True, use_bias_correction_kl=True)
    with pytest.raises(ValueError, match="greater than 1"):
        LossConfig(loss_type="grpo", ratio_clip_c=0.5)
    with pytest.warns(UserWarning, match="GSPO normalizes per sequence"):
        LossConfig(loss_type="dapo", importance_sampling_level="sequence")
