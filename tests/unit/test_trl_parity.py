"""tidal's policy loss vs TRL 1.16's own `GRPOTrainer._compute_loss`, in float64, on fresh random inputs.

TRL keeps its loss inside one method of its trainer, so the test drives that method on an object made with
`object.__new__(GRPOTrainer)` that carries only the attributes `_compute_loss` reads, with a stand-in for the
model forward (`_get_per_token_logps_and_entropies` returns the given logprobs, a leaf with grad, and
entropies). The vLLM importance-sampling weight TRL computes inside `_generate_and_score_completions` (a
generation method that needs a model and vLLM) is rebuilt here from its code: `trl_is_ratio`. tidal gets the
same (B, T) tensors as one packed micro-batch, one sequence per row; loss, gradient wrt the logprobs (and the
entropies, for the entropy bonus) and the reported metrics must agree to 1e-10 relative for every loss type and IS mode.

Runs where TRL 1.16 is importable: installed in the environment, or in `.venv/bench-trl` (`make bench`,
`make test`); skipped otherwise.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tidal.config.train import LossConfig
from tidal.trainer.step.loss import PER_SEQUENCE, LossInputs, LossScale, policy_loss

BENCH_TRL = Path(__file__).resolve().parents[2] / ".venv" / "bench-trl"


def import_trl() -> Any:
    """TRL's trainer module, from the environment or `.venv/bench-trl`; skips the test without one."""
    try:
        import trl  # noqa: F401
    except ImportError:
        if not BENCH_TRL.is_dir():
            pytest.skip("TRL is not importable (make bench / make test install it into .venv/bench-trl)")
        sys.path.append(str(BENCH_TRL))
    trl_mod = pytest.importorskip("trl")
    if trl_mod.__version__ != "1.16.0":
        pytest.skip(f"TRL {trl_mod.__version__} is not 1.16.0")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its vLLM version check
        from trl.trainer import grpo_trainer
    return grpo_trainer


class Accelerator:
    """One process: what `_compute_loss` and `get_high_entropy_mask` call on `self.accelerator`."""

    num_processes = 1
    sync_gradients = True

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_for_metrics(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def reduce(self, x: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return x

    def pad_across_processes(self, x: torch.Tensor, dim: int = 0, pad_index: float = 0) -> torch.Tensor:
        return x


IS_MODES = {"token_truncate": "truncated", "token_mask": "masked", "sequence_truncate": "sequence_truncated",
            "sequence_mask": "sequence_masked"}
"""TRL's vllm_importance_sampling_mode -> train loss.is_correction."""


def trl_is_ratio(old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, mode: str, lo: float | None,
                 hi: float | None) -> torch.Tensor:
    """TRL 1.16's vLLM IS weight, (B, T) or (B, 1), as `_generate_and_score_completions` computes it."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=lo, max=hi)
    bad = (ratio < (-math.inf if lo is None else lo)) | (ratio > (math.inf if hi is None else hi))
    return ratio.masked_fill(bad, 0.0)


def case(gen: torch.Generator, rows: int, cols: int) -> dict[str, torch.Tensor]:
    """(B, T) float64 completions of uneven lengths (>= 1 token), drifted old / inference / reference
    logprobs, per-sequence advantages of both signs, float32-exact entropies (TRL's quantile is float32)."""
    lengths = torch.randint(1, cols + 1, (rows,), generator=gen)
    mask = (torch.arange(cols)[None, :] < lengths[:, None]).double()

    def noise(s: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, dtype=torch.float64) * s

    lp = -torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 3
    return {"lp": lp, "old": lp + noise(0.3), "inf": lp + noise(0.25), "ref": lp + noise(0.4), "mask": mask,
            "adv": torch.randn(rows, generator=gen, dtype=torch.float64),
            "ent": (torch.rand(rows, cols, generator=gen) * 3).double()}


def trl_loss(grpo_trainer: Any, c: dict[str, torch.Tensor], trl: dict[str, Any], t: Any = None,
             extra_args: dict[str, Any] | None = None, ga: int = 1, sync: bool = True,
             items: torch.Tensor | None = None) -> tuple[float, torch.Tensor, dict[str, float]]:
    """TRL's loss, its gradient wrt the logprobs and entropies (2B, T) and its metrics, from `_compute_loss`
    itself; `t`: a stand-in trainer kept across calls (adaptive entropy), `ga` micro-batches per optimizer step
    (`sync`: the last of them), `items`: the tokens of the optimizer step (dapo's normalizer)."""
    lp, ent = c["lp"].clone().requires_grad_(True), c["ent"].clone().requires_grad_(True)
    rows, cols = lp.shape
    if t is None:
        t = object.__new__(grpo_trainer.GRPOTrainer)
        t.__dict__.update(entropy_coef=trl["entropy_coef"], use_adaptive_entropy=False)
    args = SimpleNamespace(use_bias_correction_kl=trl["use_bias_correction_kl"], delta=trl["delta"],
                           sapo_temperature_pos=trl["sapo_temperature_pos"],
                           sapo_temperature_neg=trl["sapo_temperature_neg"], steps_per_generation=1,
                           **{k: trl[k] for k in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                                                  "vespo_lambda_neg")})
    args.__dict__.update(extra_args or {})
    accelerator = Accelerator()
    accelerator.sync_gradients = sync
    eps_high = trl["epsilon_high"] if trl["epsilon_high"] is not None else trl["epsilon"]
    t.__dict__.update(
        args=args, accelerator=accelerator, model=SimpleNamespace(training=True), aux_loss_enabled=False,
        loss_type=trl["loss_type"], beta=trl["beta"], epsilon_low=trl["epsilon"], epsilon_high=eps_high,
        importance_sampling_level=trl["importance_sampling_level"], top_entropy_quantile=trl["top_entropy_quantile"],
        off_policy_mask_threshold=trl["off_policy_mask_threshold"], use_vllm=True,
        vllm_importance_sampling_correction=trl["vllm_importance_sampling_correction"],
        current_gradient_accumulation_steps=ga, max_completion_length=cols,
        _entropy_bonus_enabled=trl["entropy_coef"] != 0 or t.use_adaptive_entropy,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, ent, None))
    inputs = {"prompt_ids": torch.zeros(rows, 1, dtype=torch.long), "prompt_mask": torch.ones(rows, 1),
              "completion_ids": torch.zeros(rows, cols, dtype=torch.long), "completion_mask": c["mask"],
              "advantages": c["adv"], "old_per_token_logps": c["old"], "sampling_per_token_logps": c["inf"],
              "ref_per_token_logps": c["ref"],
              "num_items_in_batch": c["mask"].sum() if items is None else items}
    if trl["vllm_importance_sampling_correction"]:
        inputs["importance_sampling_ratio"] = trl_is_ratio(
            c["old"], c["inf"], c["mask"], trl["vllm_importance_sampling_mode"],
            trl["vllm_importance_sampling_clip_min"], trl["vllm_importance_sampling_clip_max"])
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # TRL's torch.where(A > 0, tau_pos, tau_neg) makes default-dtype tensors
    try:
        loss = t._compute_loss(None, inputs)
    finally:
        torch.set_default_dtype(default)
    loss.backward()
    metrics = {k: v[-1] for k, v in t._metrics["train"].items()}
    if trl["vllm_importance_sampling_correction"]:  # TRL logs this one in its generation method
        w = inputs["importance_sampling_ratio"]
        metrics["is_weight"] = float(w.mean() if w.shape[1] == 1 else w[c["mask"].bool()].mean())
    return float(loss.detach()), torch.cat([lp.grad, ent.grad if ent.grad is not None else torch.zeros_like(ent)]), \
        metrics


TRL_DEFAULTS: dict[str, Any] = {
    "loss_type": "dapo", "beta": 0.0, "epsilon": 0.2, "epsilon_high": None, "delta": None,
    "importance_sampling_level": "token", "top_entropy_quantile": 1.0, "off_policy_mask_threshold": None,
    "use_bias_correction_kl": True, "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_min": None,
    "vllm_importance_sampling_clip_max": 3.0, "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05,
    "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0, "entropy_coef": 0.0}
"""TRL 1.16 GRPOConfig's defaults of the keys the loss reads."""

NO_SEED_MASKS = {"token_mask_low": 0.0, "token_mask_high": math.inf, "geo_mask_low": 0.0, "geo_mask_high": math.inf,
                 "sequence_mask_low": 0.0, "sequence_mask_high": math.inf}
"""Seed 000's trainer/inference masks off (TRL has none)."""


def tidal_config(trl: dict[str, Any]) -> LossConfig:
    """The train `loss` section meaning `trl` (what `tidal.api.grpo_config.to_tidal` derives)."""
    keys: dict[str, Any] = {k: trl[k] for k in ("loss_type", "beta", "epsilon", "epsilon_high", "delta",
                                                "importance_sampling_level", "top_entropy_quantile",
                                                "off_policy_mask_threshold", "entropy_coef")}
    keys["use_bias_correction_kl"] = trl["use_bias_correction_kl"] and trl["beta"] > 0
    if trl["loss_type"] == "sapo":
        keys |= {k: trl[k] for k in ("sapo_temperature_pos", "sapo_temperature_neg")}
    if trl["loss_type"] == "vespo":
        keys |= {k: trl[k] for k in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")}
    if trl["vllm_importance_sampling_correction"]:
        hi = trl["vllm_importance_sampling_clip_max"]
        keys |= {"is_correction": IS_MODES[trl["vllm_importance_sampling_mode"]],
                 "is_cap": math.inf if hi is None else hi, "is_cap_min": trl["vllm_importance_sampling_clip_min"]}
    return LossConfig.model_validate(keys | NO_SEED_MASKS)


def tidal_loss(c: dict[str, torch.Tensor], cfg: LossConfig, scale: LossScale | None = None,
               entropy_coef: float | None = None) -> tuple[float, torch.Tensor, dict[str, float]]:
    """tidal's loss, gradient (2B, T) and metrics (sums over tokens, or sequences for PER_SEQUENCE), or with
    `scale` (one micro-batch of a larger optimizer step) its raw sums."""
    lp, ent = c["lp"].clone().requires_grad_(True), c["ent"].clone().requires_grad_(True)
    rows, cols = lp.shape
    seq_ids = torch.arange(rows)[:, None].expand(rows, cols).contiguous()
    x = LossInputs(logprobs=lp, old_logprobs=c["old"], inference_logprobs=c["inf"],
                   advantages=c["adv"][:, None].expand(rows, cols), loss_mask=c["mask"].bool(), seq_ids=seq_ids,
                   ref_logprobs=c["ref"], entropy=ent)
    one = scale is None
    scale = scale or LossScale(step_tokens=float(c["mask"].sum()), step_sequences=rows, micro_batches=1,
                               max_completion_len=cols)
    loss, sums = policy_loss(x, cfg, scale, entropy_coef)
    loss.backward()
    assert lp.grad is not None
    metrics = {k: v / (sums["sequences"] if k in PER_SEQUENCE else sums["tokens"]) for k, v in sums.items()}
    grads = torch.cat([lp.grad, ent.grad if ent.grad is not None else torch.zeros_like(ent)])
    return float(loss.detach()), grads, metrics if one else dict(sums)


def metric_pairs(trl: dict[str, Any]) -> list[tuple[str, str]]:
    """(TRL metric, tidal metric) pairs reported for `trl`."""
    pairs = [("entropy", "entropy")]
    if trl["beta"]:
        pairs.append(("kl", "kl"))
    token = trl["importance_sampling_level"] == "token"  # sequence level: TRL counts clipped sequences
    if trl["loss_type"] == "cispo" and token:
        pairs.append(("cispo_clip_ratio", "clip_ratio/high_mean"))
    elif trl["loss_type"] == "vespo":
        pairs.append(("vespo/phi_seq_mean", "vespo/phi_seq_mean"))
    elif trl["loss_type"] not in ("sapo", "cispo") and token:
        pairs += [(f"clip_ratio/{k}_mean", f"clip_ratio/{k}_mean") for k in ("low", "high", "region")]
    if trl["vllm_importance_sampling_correction"]:
        seq = trl["vllm_importance_sampling_mode"].startswith("sequence") and trl["loss_type"] != "vespo"
        pairs.append(("is_weight", "is_weight/sequence_mean" if seq else "is_weight/mean"))
    return pairs


ENTROPY_Q = 0.37
"""TRL takes the entropy quantile in float32: at a whole-number position (1 - q)(n - 1) its threshold can land one
float32 step above the exact element and drop that token. With 1 - q = 0.63 and n <= 88 tokens the position
is never whole (n = 1 aside), so both sides keep the same tokens."""
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
CASES: list[dict[str, Any]] = (
    [{"loss_type": t} for t in LOSS_TYPES]
    + [{"loss_type": t, "vllm_importance_sampling_mode": m} for t in LOSS_TYPES for m in IS_MODES
       if not (t == "vespo" and m.startswith("sequence"))]
    + [{"loss_type": t, "vllm_importance_sampling_correction": False, "beta": 0.1} for t in LOSS_TYPES]
    + [{"loss_type": t, "beta": 0.2, "epsilon_high": 0.28, "top_entropy_quantile": ENTROPY_Q,
        "off_policy_mask_threshold": 0.02} for t in LOSS_TYPES]
    + [{"loss_type": t, "importance_sampling_level": "sequence", "beta": 0.05} for t in LOSS_TYPES
       if t != "vespo"]
    + [{"loss_type": "cispo", "epsilon_high": 1.2, "vllm_importance_sampling_mode": "token_mask",
        "vllm_importance_sampling_clip_min": 0.6, "vllm_importance_sampling_clip_max": 1.6},
       {"loss_type": "grpo", "delta": 1.5, "vllm_importance_sampling_mode": "sequence_truncate",
        "vllm_importance_sampling_clip_min": 0.9, "vllm_importance_sampling_clip_max": 1.1},
       {"loss_type": "sapo", "sapo_temperature_pos": 2.0, "sapo_temperature_neg": 0.5, "beta": 0.1,
        "use_bias_correction_kl": False},
       {"loss_type": "vespo", "vespo_k_pos": 1.5, "vespo_lambda_pos": 0.5, "vespo_k_neg": 4.0,
        "vespo_lambda_neg": 1.0, "vllm_importance_sampling_mode": "token_mask",
        "vllm_importance_sampling_clip_max": 1.3},
       {"loss_type": "dapo", "vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_min": 0.5,
        "vllm_importance_sampling_clip_max": None},
       # the script: cispo, sequence_mask, entropy_coef
       {"loss_type": "cispo", "epsilon_high": 5.0, "vllm_importance_sampling_mode": "sequence_mask",
        "entropy_coef": 0.01}]
    + [{"loss_type": t, "entropy_coef": 0.05, "top_entropy_quantile": ENTROPY_Q} for t in LOSS_TYPES])


@pytest.mark.parametrize("keys", CASES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_tidal_loss_equals_trl_compute_loss(keys: dict[str, Any]) -> None:
    grpo_trainer = import_trl()
    trl = TRL_DEFAULTS | ({"vllm_importance_sampling_mode": "token_truncate"} if keys["loss_type"] == "vespo"
                          else {}) | keys  # TRL refuses vespo with its default sequence_mask
    cfg = tidal_config(trl)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh inputs every run
    for rows, cols in ((3, 5), (6, 11), (8, 4)):
        c = case(gen, rows, cols)
        want, want_grad, want_m = trl_loss(grpo_trainer, c, trl)
        got, got_grad, got_m = tidal_loss(c, cfg)
        assert got == pytest.approx(want, rel=1e-10, abs=1e-14), (rows, cols)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-14)
        for theirs, ours in metric_pairs(trl):
            assert got_m.get(ours, 0.0) == pytest.approx(want_m[theirs], rel=1e-10, abs=1e-14), (theirs, rows)


@pytest.mark.parametrize(("keys", "target"), [({"loss_type": "dapo"}, 1.5),
                                              ({"loss_type": "grpo", "top_entropy_quantile": ENTROPY_Q}, 2.445)],
                         ids=["dapo", "grpo-entropy-mask"])
def test_adaptive_entropy_follows_trl_over_steps(keys: dict[str, Any], target: float) -> None:
    """`use_adaptive_entropy`: over optimizer steps of two micro-batches each, the coefficient TRL's
    `_compute_loss` applies and updates (its window over the micro-batches) is tidal's `EntropyControl`'s, and so
    are each micro-batch's loss and gradients."""
    from tidal.trainer.step.entropy_control import EntropyControl

    grpo_trainer = import_trl()
    trl = TRL_DEFAULTS | {"entropy_coef": 0.02} | keys
    delta = 0.01  # `target`: the mean entropy of the bonus's tokens, so the coefficient moves both ways
    cfg = LossConfig.model_validate(tidal_config(trl).model_dump() | {
        "use_adaptive_entropy": True, "entropy_target": target, "entropy_coef_delta": delta,
        "entropy_coef_max": 0.05})
    t = object.__new__(grpo_trainer.GRPOTrainer)
    t.__dict__.update(entropy_coef=0.02, use_adaptive_entropy=True, _last_world_entropy=float("inf"),
                      _entropy_window_stats=None)
    ec = EntropyControl(0.02)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    rows, cols, moved = 4, 6, set()
    for _ in range(12):  # optimizer steps
        cases = [case(gen, rows, cols) for _ in range(2)]
        tokens = sum(c["mask"].sum() for c in cases)
        coef = ec.applied(cfg)
        for j, c in enumerate(cases):
            want, want_grad, _ = trl_loss(grpo_trainer, c, trl, t, {
                "use_adaptive_entropy": True, "entropy_target": target, "entropy_coef_delta": delta,
                "entropy_coef_min": 0.0, "entropy_coef_max": 0.05, "steps_per_generation": 2},
                ga=2, sync=j == 1, items=tokens)
            scale = LossScale(step_tokens=float(tokens), step_sequences=2 * rows, micro_batches=2,
                              max_completion_len=cols)
            got, got_grad, sums = tidal_loss(c, cfg, scale, coef)
            ec.add(sums)
            assert got == pytest.approx(want, rel=1e-10, abs=1e-14)
            torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-14)
        ec.step(cfg, lambda v: v)
        assert ec.coef == pytest.approx(t.entropy_coef, abs=1e-15)
        assert ec.last_entropy == pytest.approx(t._last_world_entropy, rel=1e-12)
        moved.add(ec.last_entropy <= target)
    assert moved == {True, False}, "the steps moved the coefficient both ways"
