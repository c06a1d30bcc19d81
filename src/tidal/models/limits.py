"""The model's own length limit against the run's lengths, before anything starts.

A model holds as many positions as its `config.json` says (`max_position_embeddings`, or the other keys vLLM
reads: `n_positions`, `max_seq_len`, ...; the smallest one set, in the text config of a vision-language model).
RoPE scaling with a `factor` (`linear`, `dynamic`; the model's own or the run's `rope_scaling`) stretches it by
that factor; `yarn`, `llama3`, `longrope` and the like leave it as is (their configs already give the stretched
length) — the rule vLLM applies (`vllm.config.model._get_and_verify_max_len`), which refuses a longer
`max_model_len` when it starts. tidal checks orch `seq_len`, train `sequence_len` and infer `max_model_len`
against that limit in the `tidal grpo` derivation (and `--dry-run`, and `GRPOTrainer(...)`), so a length the model
cannot hold exits 2 naming the key, the model and its limit instead of failing once vLLM is up. Pure dict logic,
torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tidal.config.load import ConfigError
from tidal.models.config import text_config
from tidal.models.rope import merge_rope, model_rope_parameters

LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
               "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
"""config.json keys that bound the positions, as vLLM reads them (the smallest one set wins)."""
UNSCALED_ROPE = ("default", "su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
"""RoPE types whose `factor` does not stretch the config's length (vLLM: already scaled there)."""


def max_positions(config: Mapping[str, Any], rope_scaling: Mapping[str, Any] | None = None,
                  key: str = "rope_scaling") -> tuple[int, str] | None:
    """(positions the model holds, how that was found) for a config.json dict with `rope_scaling` (the run's;
    merged over the model's own RoPE parameters, `tidal.models.rope`) applied; None when no key bounds it."""
    text = text_config(config)
    found = [(int(text[k]), k) for k in LENGTH_KEYS if isinstance(text.get(k), int | float) and text[k] > 0]
    if not found:
        return None
    limit, how = min(found)
    rope = model_rope_parameters(text)
    if rope_scaling:
        rope = merge_rope(rope, rope_scaling, key)
    if "gemma3" in str(text.get("model_type", "")):  # vLLM: Gemma 3's length is already scaled
        return limit, how
    per_type = list(rope.values()) if rope and all(isinstance(v, Mapping) for v in rope.values()) else [rope]
    factor = 1.0
    for params in per_type:
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in UNSCALED_ROPE and params.get("factor"):
            factor = float(params["factor"])
    if factor != 1.0:
        return int(limit * factor), f"{how} {limit} x rope factor {factor:g}"
    return limit, how


def check_lengths(model: str, config: Mapping[str, Any], lengths: Mapping[str, int | None],
                  rope_scaling: Mapping[str, Any] | None = None) -> None:
    """Raise `ConfigError` for the first of `lengths` (`{"orch seq_len": 2048, ...}`; None: unset) beyond the
    positions model `model` (its config.json dict `config`) holds with `rope_scaling`."""
    found = max_positions(config, rope_scaling)
    if found is None:
        return
    limit, how = found
    for name, value in lengths.items():
        if value is not None and value > limit:
            raise ConfigError(f"{name} is {value}, but model {model} holds {limit} positions ({how} in its "
                              f"config.json); set {name} to at most {limit}, or give rope_scaling that extends the "
                              f"model (e.g. {{rope_type: dynamic, factor: {-(-value // limit)}}})")
