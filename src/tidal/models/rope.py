"""RoPE scaling as given in train/infer `rope_scaling`, merged over a model's own RoPE parameters.

Since transformers 5 a config's `rope_parameters` holds `rope_theta` next to the scaling keys, so replacing the
dict with the user's (what vLLM's `--hf-overrides {"rope_scaling": ...}` does) silently resets `rope_theta`.
Both the trainer and the inference server therefore merge: keys the user does not give keep the model's
values. The legacy `type` key is read as `rope_type`; a model with one dict per layer type (e.g. Gemma 3) takes
`{layer_type: {...}}`. Pure dict logic (torch-free), shared by `tidal.trainer.model.load` and
`tidal.inference.backends.vllm.server`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tidal.config.load import ConfigError


def model_rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """A `config.json` dict's RoPE parameters in transformers 5's form (`rope_parameters`, or the older
    `rope_theta` + `rope_scaling` pair)."""
    if isinstance(config.get("rope_parameters"), dict):
        return dict(config["rope_parameters"])
    old = dict(config.get("rope_scaling") or {})
    if "type" in old:
        old.setdefault("rope_type", old.pop("type"))
    if "rope_theta" in config:
        old.setdefault("rope_theta", config["rope_theta"])
    return old


def merge_rope(current: Mapping[str, Any] | None, rope_scaling: Mapping[str, Any], key: str) -> dict[str, Any]:
    """`rope_scaling` (the user's, from `key`) merged over a model's `current` RoPE parameters."""
    new = dict(rope_scaling)
    if "type" in new:
        new.setdefault("rope_type", new.pop("type"))
    old = dict(current or {})
    if old and all(isinstance(v, dict) for v in old.values()):  # one dict per layer type
        if not set(new) <= set(old) or not all(isinstance(v, dict) for v in new.values()):
            raise ConfigError(f"{key} {dict(rope_scaling)}: this model has RoPE parameters per layer type "
                              f"({', '.join(old)}); give rope_scaling as {{layer_type: {{...}}}} with those keys")
        return {k: {**v, **new.get(k, {})} for k, v in old.items()}
    return {**old, **new}
