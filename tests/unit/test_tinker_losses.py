"""tidal.tinker.losses: every built-in loss of the Tinker SDK and its gradient against float64 references written
from Tinker's documented formulas (https://tinker-docs.thinkingmachines.ai/losses), independently in numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.tinker.losses import LOSSES, LossError, check_request, datum_loss

N = 37


def _case(seed: int, shape: tuple[int, ...] = (N,)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lp = -rng.exponential(1.0, shape)
    q = lp + rng.normal(0.0, 0.4, shape)  # ratios well inside and outside [0.8, 1.2]
    return {"lp": lp, "logprobs": q, "advantages": rng.normal(0.0, 1.0, shape),
            "weights": rng.integers(0, 2, shape).astype(np.float64),
            "sequence_ratio_mask": (rng.random(shape) < 0.7).astype(np.float64)}


# --- float64 references: (loss, d loss / d lp) straight from the documented formulas ---------------------------

def ref_cross_entropy(c, cfg):
    return -(c["lp"] * c["weights"]).sum(), -c["weights"]


def ref_importance_sampling(c, cfg):
    r = np.exp(c["lp"] - c["logprobs"])
    return -(r * c["advantages"]).sum(), -r * c["advantages"]


def _ppo_ref(r, a, lo, hi, dr):
    """min(r A, clip(r) A); the gradient passes through r where the unclipped term is the minimum or r is inside
    the bounds (there clip(r) = r), else it is 0. `dr`: d r / d lp."""
    unclipped, clipped = r * a, np.clip(r, lo, hi) * a
    obj = np.minimum(unclipped, clipped)
    live = (unclipped <= clipped) | ((r >= lo) & (r <= hi))
    return -obj.sum(), np.where(live, -a * dr, 0.0)


def ref_ppo(c, cfg):
    r = np.exp(c["lp"] - c["logprobs"])
    return _ppo_ref(r, c["advantages"], cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2), r)


def ref_cispo(c, cfg):
    r = np.clip(np.exp(c["lp"] - c["logprobs"]), cfg.get("clip_low_threshold", 0.0),
                cfg.get("clip_high_threshold", 4.0))
    return -(r * c["lp"] * c["advantages"]).sum(), -r * c["advantages"]


def ref_dro(c, cfg):
    beta = cfg.get("beta", 0.05)
    d = c["lp"] - c["logprobs"]
    return -(c["lp"] * c["advantages"] - 0.5 * beta * d ** 2).sum(), -(c["advantages"] - beta * d)


def ref_gspo(c, cfg):
    m = c["sequence_ratio_mask"] != 0
    s = np.exp(np.mean((c["lp"] - c["logprobs"])[m]))
    r = np.full_like(c["lp"], s)  # every token carries the sequence ratio; d r_t / d lp_t = s
    return _ppo_ref(r, c["advantages"], cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2), r)


REFS = {"cross_entropy": ref_cross_entropy, "importance_sampling": ref_importance_sampling, "ppo": ref_ppo,
        "cispo": ref_cispo, "dro": ref_dro, "gspo": ref_gspo}
KEYS = {"cross_entropy": ["weights"], "importance_sampling": ["logprobs", "advantages"],
        "ppo": ["logprobs", "advantages"], "cispo": ["logprobs", "advantages"], "dro": ["logprobs", "advantages"],
        "gspo": ["logprobs", "advantages", "sequence_ratio_mask"]}
CONFIGS = {"cross_entropy": [{}], "importance_sampling": [{}],
           "ppo": [{}, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}],
           "cispo": [{}, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}],
           "dro": [{}, {"beta": 0.3}], "gspo": [{}, {"clip_low_threshold": 0.95, "clip_high_threshold": 1.02}]}


def run(loss_fn, c, cfg):
    lp = torch.tensor(c["lp"], dtype=torch.float64, requires_grad=True)
    inputs = {k: torch.tensor(c[k], dtype=torch.float64) for k in KEYS[loss_fn]}
    inputs["target_tokens"] = torch.zeros(c["lp"].shape, dtype=torch.int64)
    loss = datum_loss(loss_fn, lp, inputs, cfg)
    loss.backward()
    return float(loss.detach()), lp.grad.numpy()


def test_every_sdk_loss_has_a_reference():
    from typing import get_args

    LossFnType = pytest.importorskip("tinker.types").LossFnType

    from tidal.tinker.losses import REFUSED

    assert set(get_args(LossFnType)) == set(LOSSES) | set(REFUSED)
    assert set(REFS) == set(LOSSES)


@pytest.mark.parametrize("loss_fn", sorted(REFS))
@pytest.mark.parametrize("shape", [(N,), (N, 3)])
def test_loss_and_gradient_match_float64_reference(loss_fn, shape):
    for seed in range(4):
        c = _case(seed, shape)
        for cfg in CONFIGS[loss_fn]:
            loss, grad = run(loss_fn, c, cfg)
            want_loss, want_grad = REFS[loss_fn](c, cfg)
            assert loss == pytest.approx(want_loss, rel=1e-12, abs=1e-12), (loss_fn, cfg)
            np.testing.assert_allclose(grad, want_grad, rtol=1e-12, atol=1e-12, err_msg=f"{loss_fn} {cfg}")


def test_clipping_is_exercised():
    """The cases cross both PPO bounds with both signs of advantage, so the clipped branches are really tested."""
    c = _case(0)
    r = np.exp(c["lp"] - c["logprobs"])
    assert (r < 0.8).any() and (r > 1.2).any()
    _, grad = ref_ppo(c, {})
    assert (grad == 0).any() and (grad != 0).any()


def test_per_token_clip_thresholds_override_config():
    c = _case(1)
    lp = torch.tensor(c["lp"], requires_grad=True)
    f64 = torch.float64
    inputs = {"target_tokens": torch.zeros(N, dtype=torch.int64), "logprobs": torch.tensor(c["logprobs"]),
              "advantages": torch.tensor(c["advantages"]), "clip_low_threshold": torch.full((N,), 0.9, dtype=f64),
              "clip_high_threshold": torch.full((N,), 1.1, dtype=f64)}
    got = float(datum_loss("ppo", lp, inputs, {}).detach())
    assert got == pytest.approx(ref_ppo(c, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})[0], rel=1e-12)


def test_cross_entropy_weights_default_to_one():
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    assert float(datum_loss("cross_entropy", lp, {"target_tokens": torch.zeros(3)}, {})) == pytest.approx(3.5)


@pytest.mark.parametrize("loss_fn, keys, cfg, match", [
    ("stable_reinforce", {"target_tokens"}, {}, "stability information"),
    ("custom", {"target_tokens"}, {}, "forward_backward_custom"),
    ("nope", {"target_tokens"}, {}, "unknown loss_fn 'nope'"),
    ("importance_sampling", {"target_tokens", "logprobs", "advantages", "mask"}, {},
     "does not take loss_fn_inputs mask"),
    ("ppo", {"target_tokens", "logprobs"}, {}, "needs loss_fn_inputs advantages"),
    ("ppo", {"target_tokens", "logprobs", "advantages"}, {"beta": 1.0}, "does not take loss_fn_config beta"),
    ("gspo", {"target_tokens", "logprobs", "advantages"}, {}, "sequence_ratio_mask"),
])
def test_refusals_name_the_key(loss_fn, keys, cfg, match):
    with pytest.raises(LossError, match=match):
        check_request(loss_fn, keys, cfg)
