"""Publish the policy after step n: `{run_dir}/broadcasts/step_{n}/` (PEFT adapter) plus a `STABLE` marker.

The adapter is saved into a temp directory that is renamed into place, then `STABLE` is written: a reader
that sees `STABLE` sees a complete adapter. Older broadcasts beyond `keep` are removed. With `merged`, the
directory also holds `merged/model.safetensors`: the base weights with the adapter folded in (W + scale * B A), under
the checkpoint's own tensor names, for inference servers that reload full weights instead of applying LoRA
(vLLM's LoRA path on CPU is ~5x slower than its plain path).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def broadcast_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "broadcasts" / f"step_{step}"


def lora_layers(model: Any) -> Iterator[tuple[str, Any]]:
    """(base checkpoint name of the weight, PEFT LoRA layer) for each LoRA-adapted module of `model`."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield f"{name.removeprefix('base_model.model.')}.weight", module


def lora_merged_weights(model: Any) -> Iterator[tuple[str, Any]]:
    """(checkpoint name, W + scale * B A) for each LoRA-adapted module, computed one module at a time; the
    training model is left untouched."""
    for key, module in lora_layers(model):
        w = module.get_base_layer().weight.detach().clone()
        for adapter in module.active_adapters:
            w += module.get_delta_weight(adapter).detach().to(w.dtype)
        yield key, w.contiguous()


def merged_state_dict(model: Any, checkpoint_keys: list[str]) -> dict[str, Any]:
    """The PEFT model's weights with each LoRA delta added, keyed like the base checkpoint (`checkpoint_keys`);
    the training model is left untouched."""
    merged = dict(lora_merged_weights(model))
    out = {}
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    for key in checkpoint_keys:
        if key in merged:
            out[key] = merged[key].cpu()
            continue
        prefix = key.removesuffix(".weight").removesuffix(".bias")
        suffix = key[len(prefix):]
        peft_key = f"base_model.model.{prefix}"
        w = params.get(f"{peft_key}.base_layer{suffix}", params.get(f"base_model.model.{key}"))
        if w is None:
            raise KeyError(f"checkpoint tensor {key} has no counterpart in the trained model")
        out[key] = w.detach().contiguous().cpu()
    return out


def publish_adapter(model: Any, run_dir: Path, step: int, keep: int | None = None,
                    merged_keys: list[str] | None = None) -> Path:
    """Save `model`'s adapter for `step` atomically (plus merged full weights when `merged_keys` lists the
    base checkpoint's tensor names); prune all but the newest `keep` broadcasts."""
    final = broadcast_dir(run_dir, step)
    tmp = final.with_name(f".{final.name}.tmp.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(final, ignore_errors=True)
    try:
        model.save_pretrained(str(tmp))  # adapter_config.json + adapter_model.safetensors
        if merged_keys is not None:
            from safetensors.torch import save_file

            (tmp / "merged").mkdir()
            save_file(merged_state_dict(model, merged_keys), str(tmp / "merged" / "model.safetensors"),
                      metadata={"format": "pt"})
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never a half-written broadcast (e.g. disk full)
        raise
    (final / ".STABLE.tmp").write_text(str(step))
    os.replace(final / ".STABLE.tmp", final / "STABLE")
    if keep is not None:
        prune(run_dir, keep)
    return final


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


def stable_steps(run_dir: Path) -> list[int]:
    """Steps with a complete broadcast, ascending."""
    root = run_dir / "broadcasts"
    steps = []
    for d in root.glob("step_*") if root.is_dir() else []:
        if (d / "STABLE").exists() and d.name[5:].isdigit():
            steps.append(int(d.name[5:]))
    return sorted(steps)


def prune(run_dir: Path, keep: int) -> None:
    for step in stable_steps(run_dir)[:-keep]:
        shutil.rmtree(broadcast_dir(run_dir, step), ignore_errors=True)
