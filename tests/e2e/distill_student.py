"""A student for the on-policy distillation tests: the bundled model with Gaussian noise on its projection weights.

`noised_copy(dst, scale, seed)` writes a copy of `tidal:tiny-reverse` to `dst` (tokenizer, chat template and config
as they are) whose linear projection weights (attention and MLP, not the tied embedding nor the norms) get
`N(0, (scale * std(W))^2)` added, so the student samples worse reversals than the bundled model (its teacher) while
keeping its vocabulary and chat format. numpy + safetensors only; no torch, no network.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from tidal.models.sources import resolve_model

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def noised_copy(dst: Path, scale: float, seed: int = 0, model: str = "tidal:tiny-reverse") -> Path:
    """`model` copied to `dst` with its projection weights noised (module doc); returns `dst`."""
    src = Path(resolve_model(model))
    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    rng = np.random.default_rng(seed)
    for name, w in weights.items():
        if any(p in name for p in PROJECTIONS) and w.ndim == 2:
            weights[name] = (w + rng.normal(0.0, scale * float(w.std()), w.shape)).astype(w.dtype)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
