"""QeRL adaptive quantization noise (seed 000, "QeRL Adaptive Quantization Noise"; arXiv:2510.11696).

Before rollouts, the inference model gets noisy copies of every RMSNorm weight (input/post-attention layer
norms, q/k norms, the final norm): `w + N(0, sigma^2)`, while the trainer keeps and trains the clean weights.
Sigma follows train `noise_scheduler`: the run's `total` steps are cut into `num_stages` equal intervals; the
first has sigma 0 (a noise-free baseline), the others decay geometrically from `sigma_start` (second interval)
to `sigma_end` (last). The noise reaches vLLM inside the merged weights the trainer publishes for each policy
(`broadcasts/step_n/merged/`), or, with the NCCL push, as every RMSNorm weight pushed beside the merged LoRA
weights (`noisy_norms`: the same values as the merged path's), so policy n's rollouts are sampled by its noisy
copy; the noise of policy n is drawn from a generator seeded by (train `seed`, n): the same on a resumed run, and
the training RNG is untouched.
"""

from __future__ import annotations

from typing import Any

import torch

from tidal.config.train import NoiseSchedulerConfig, TrainConfig


def qerl_sigma(step: int, total: int, cfg: NoiseSchedulerConfig) -> float:
    """Sigma for the policy of training step `step` (1-based) of a `total`-step run."""
    if not cfg.enabled or total < 1:
        return 0.0
    stage = min(cfg.num_stages - 1, (max(step, 1) - 1) * cfg.num_stages // total)
    if stage == 0:
        return 0.0
    span = max(cfg.num_stages - 2, 1)
    return float(cfg.sigma_start * (cfg.sigma_end / cfg.sigma_start) ** ((stage - 1) / span))


def qerl_noise(cfg: TrainConfig, step: int) -> tuple[float, int] | None:
    """(sigma, seed) of policy `step`'s QeRL noise, None without noise (`qerl_sigma`)."""
    sigma = qerl_sigma(step, cfg.max_steps, cfg.noise_scheduler)
    return (sigma, cfg.seed) if sigma > 0 else None


def norm_keys(model: Any) -> list[str]:
    """Checkpoint names of every RMSNorm weight of `model` (PEFT-wrapped or plain)."""
    keys = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if "rmsnorm" in type(module).__name__.lower() and isinstance(weight, torch.Tensor):
            keys.append(f"{name.removeprefix('base_model.model.')}.weight")
    return keys


def add_norm_noise(weights: dict[str, torch.Tensor], keys: list[str], sigma: float, seed: int, step: int) -> None:
    """Add N(0, sigma^2) to `weights[k]` for each of `keys`, in place (a published copy, never the trainer's)."""
    if sigma <= 0:
        return
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    for k in keys:
        w = weights[k]
        noise = torch.randn(w.shape, generator=gen, dtype=torch.float32) * sigma
        weights[k] = (w.float() + noise).to(w.dtype)


def noisy_norms(model: Any, sigma: float, seed: int, step: int) -> dict[str, torch.Tensor]:
    """Checkpoint name -> every RMSNorm weight of `model` with policy `step`'s noise (clean copies at sigma 0, which
    undo an earlier policy's noise): what the NCCL push sends beside the merged weights. Same draws, in the same
    order, as `add_norm_noise` on the merged weights."""
    keys = norm_keys(model)
    modules = {f"{n.removeprefix('base_model.model.')}.weight": m for n, m in model.named_modules()}
    norms = {k: modules[k].weight.detach().clone() for k in keys}
    add_norm_noise(norms, keys, sigma, seed, step)
    return norms
