"""Orch `weight_broadcast.reload: factors`: merge a policy's LoRA factors into vLLM's weights inside its worker.

The trainer publishes policy n as its PEFT adapter only (`broadcasts/step_n/adapter_model.safetensors`: each adapted
module's A (r, in) and B (out, r); `adapter_config.json`: r and alpha, so scale = alpha / r, or alpha / sqrt(r) with
rsLoRA; ~20 MB for SmolLM2-135M at r16 on all linear layers, against ~425 MB for the merged copy of the adapted
weights). The orchestrator asks each server's worker (`POST /collective_rpc {"method": "tidal_merge_lora"}`,
`tidal.inference.backends.vllm.client.VllmClient.merge_lora`) to serve it: the worker computes, for each adapted
checkpoint weight, W = W_base + (B @ A) * scale, and hands those checkpoint-format tensors to vLLM's own in-place
reload (`reload_weights(weights_iterator=...)`: the model's `load_weights` maps `q_proj` / `k_proj` / `v_proj` onto
the shards of `qkv_proj` and `gate_proj` / `up_proj` onto `gate_up_proj` with its stacked-params mapping, shards for
tensor parallelism, and re-runs the CPU GEMM pre-pack of the layers it touched). Nothing else changes: embeddings,
norms and the LM head stay as loaded (tidal's LoRA never adapts them, `tidal.models.lora`).

Exactness: the sum is the trainer's (`tidal.trainer.publish.broadcast.lora_merged_weights`: PEFT's
`get_delta_weight`, (B @ A) * scale in the factors' dtype, cast to the weight's dtype, added to a copy of the base), so
vLLM gets the tensors a merged reload would have read from disk. W_base comes from an exact copy of the adapted
weights, read once from the checkpoint vLLM started with (`model_config.hf_config.name_or_path`: an in-place reload
changes `model_config.model`, never that) and kept in the worker in the checkpoint's dtype: every merge starts from
the base, so nothing drifts however many policies follow. Memory: one more copy of the adapted weights in the
worker (SmolLM2-135M, all linear layers: 425 MB in float32; a bf16 checkpoint keeps half that).

Refused (an error naming the key): an adapter_config.json with DoRA (`use_dora`), `modules_to_save`,
`fan_in_fan_out`, trained biases, per-module rank or alpha patterns, or an adapted module whose weight the base
checkpoint does not hold under the same name.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

PEFT_PREFIX = "base_model.model."
"""PEFT's prefix on every key of a saved adapter."""
KEY = "orch weight_broadcast.reload: factors"
"""The key that selects this path, named in every refusal."""
REFUSED_CONFIG = {"use_dora": "DoRA rescales each column by a learned magnitude: W + scale * B A is not its weight",
                  "modules_to_save": "fully trained copies of whole modules are no LoRA factors",
                  "fan_in_fan_out": "transposed (Conv1D) weights are not vLLM's linear layers",
                  "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas",
                  "lora_bias": "trained LoRA biases"}
"""adapter_config.json keys whose set values the worker merge refuses, and why."""


def lora_scale(config: dict[str, Any]) -> float:
    """PEFT's LoRA scale for an adapter config (`peft.tuners.lora.layer.LoraLayer.update_layer`): alpha / r, or
    alpha / sqrt(r) with rsLoRA. Refuses the configs `REFUSED_CONFIG` lists and a bias other than none."""
    for key, why in REFUSED_CONFIG.items():
        if config.get(key):
            raise ValueError(f"adapter_config.json sets {key}: {config[key]!r}; {KEY} cannot merge it ({why}): use "
                             f"orch weight_broadcast.reload: merged")
    if config.get("bias", "none") != "none":
        raise ValueError(f"adapter_config.json sets bias: {config['bias']!r}; {KEY} merges weights only: use "
                         f"orch weight_broadcast.reload: merged")
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def read_factors(adapter_dir: Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    """({checkpoint weight name: (A (r, in), B (out, r))}, scale) of the PEFT adapter in `adapter_dir`."""
    from safetensors.torch import load_file

    scale = lora_scale(json.loads((adapter_dir / "adapter_config.json").read_text()))
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        module = key.removeprefix(PEFT_PREFIX).split(".lora_A.")[0]
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise ValueError(f"{adapter_dir / 'adapter_model.safetensors'}: {key} has no lora_B partner")
        factors[f"{module}.weight"] = (a, b)
    if not factors:
        raise ValueError(f"{adapter_dir / 'adapter_model.safetensors'} holds no LoRA factors ({KEY})")
    return factors, scale


def delta(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """(B @ A) * scale as PEFT computes it (`Linear.get_delta_weight`): in the factors' dtype, through float32 for
    16-bit factors on a CPU."""
    cast = a.device.type == "cpu" and a.dtype in (torch.float16, torch.bfloat16)
    out = (b.float() @ a.float()) * scale if cast else (b @ a) * scale
    return out.to(a.dtype) if cast else out


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """W_base + (B @ A) * scale in `dtype` (vLLM's): what the trainer's merged copy holds for this weight, as a
    merged reload would load it. The sum is taken in the wider of the checkpoint's dtype and float32 and rounded to
    `dtype` once: a float32 checkpoint served in bfloat16 gets bf16(W + delta), not bf16(bf16(W) + delta), which
    would drop every update smaller than half a bfloat16 step of its weight (early in a run, nearly all of them:
    the sampler would keep the base policy while the trainer scores the new one)."""
    wide = torch.promote_types(base.dtype, torch.float32)
    w = base.to(dtype=wide, copy=True)
    w += delta(a.to(w.device), b.to(w.device), scale).to(wide)
    return w if dtype == wide else w.to(dtype)


def read_base(model_dir: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` of the safetensors checkpoint in `model_dir`, as stored (single file or sharded)."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no safetensors checkpoint to take the base weights from ({KEY})")
    wanted, out = set(names), {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for key in wanted.intersection(h.keys()):
                out[key] = h.get_tensor(key).clone()
    missing = sorted(wanted - set(out))
    if missing:
        raise ValueError(f"the adapter adapts {len(missing)} weight(s) that {model_dir} does not hold under that name "
                         f"(e.g. {', '.join(missing[:3])}): {KEY} needs the trainer's module names to be the "
                         f"checkpoint's; use orch weight_broadcast.reload: merged for this model")
    return out


class LoraMergeExtension:
    """Mixed into vLLM's worker (`tidal.inference.backends.vllm.worker_ext.TidalWorkerExtension`): `tidal_merge_lora`,
    and the base copy it keeps (`_tidal_base`, filled at the first merge)."""

    model_runner: Any
    vllm_config: Any

    def _tidal_base_dir(self) -> Path:
        hf = self.vllm_config.model_config.hf_config
        return Path(getattr(hf, "name_or_path", "") or self.vllm_config.model_config.model)

    def tidal_merge_lora(self, adapter_dir: str) -> dict[str, Any]:
        """Serve the LoRA policy in `adapter_dir` (PEFT adapter): W = W_base + (B @ A) * scale for each adapted
        weight, through vLLM's in-place reload. Returns {"weights", "base_bytes", "read_s", "merge_s"}."""
        t0 = time.perf_counter()
        factors, scale = read_factors(Path(adapter_dir))
        base: dict[str, torch.Tensor] = getattr(self, "_tidal_base", {})
        new = [n for n in factors if n not in base]
        if new:
            base = {**base, **read_base(self._tidal_base_dir(), new)}
            self._tidal_base = base
        dtype = self.vllm_config.model_config.dtype
        t1 = time.perf_counter()

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, (a, b) in factors.items():
                yield name, merged_weight(base[name], a, b, scale, dtype)

        worker: Any = self  # vLLM's Worker: its reload_weights runs under the worker's vLLM config
        worker.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
        return {"weights": len(factors), "base_bytes": sum(t.numel() * t.element_size() for t in base.values()),
                "read_s": t1 - t0, "merge_s": time.perf_counter() - t1}
