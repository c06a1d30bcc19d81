"""QeRL adaptive quantization noise (seed 000, "QeRL Adaptive Quantization Noise"; arXiv:2510.11696).

Before rollouts, the inference model gets noisy copies of every RMSNorm weight (input/post-attention layer
norms, q/k norms, the final norm): `w + N(0, sigma^2)`, while the trainer keeps and trains the clean weights.
Sigma follows train `noise_scheduler`: the run's `total` steps are cut into `num_stages` equal intervals; the
first has sigma 0 (a noise-free baseline), the others decay geometrically from `sigma_start` (second interval)
to `sigma_end` (last). The noise reaches vLLM inside the merged weights the trainer publishes for each policy
(`broadcasts/step_n/merged/`), so policy n's rollouts are sampled by its noisy copy; the noise of policy n is
drawn from a generator seeded by (train `seed`, n): the same on a resumed run, and the training RNG is untouched.
"""

from __future__ import annotations

from typing import Any

import torch

from tidal.config.train import NoiseSchedulerConfig


def qerl_sigma(step: int, total: int, cfg: NoiseSchedulerConfig) -> float:
    """Sigma for the policy of training step `step` (1-based) of a `total`-step run."""
    if not cfg.enabled or total < 1:
        return 0.0
    stage = min(cfg.num_stages - 1, (max(step, 1) - 1) * cfg.num_stages // total)
    if stage == 0:
        return 0.0
    span = max(cfg.num_stages - 2, 1)
    return float(cfg.sigma_start * (cfg.sigma_end / cfg.sigma_start) ** ((stage - 1) / span))


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
