"""`tidal grpo` with orch `weight_broadcast.reload: factors`: what it needs set, and where it cannot work.

With `factors` the trainer publishes each LoRA policy as its adapter only and every vLLM worker merges the factors
into its weights in place (`tidal.inference.backends.vllm.lora_merge`). `factor_reloads` sets the other two configs
(train `broadcast_merged: false`: no merged copy is written; infer `weight_reload: true`: the dev route and tidal's
worker extension) and refuses, before anything starts (exit 2, naming the key), where the merge cannot serve the
trainer's policy (`refusal`):

- train `lora: false`: there are no factors, every weight changes;
- train `qlora_bnb` / `qlora_fp8`: the trainer's base is the quantized one dequantized, vLLM's the original;
- train `noise_scheduler.enabled` (QeRL): the noisy norms travel only in merged copies or the push;
- infer `backend: sglang`: the merge runs in vLLM's worker;
- infer `tp` > 1: each worker would merge into its shard through vLLM's loader; not verified here (one CPU);
- a quantized checkpoint (`quantization_config`) or infer extra_args `--quantization`: vLLM's quantized weights
  take no float32 sum;
- orch `weight_broadcast.type: nccl` (the push carries merged weights itself).
DoRA, `modules_to_save` and the like have no train key in tidal (its LoRA is PEFT's plain LoRA); an adapter that
has them is refused by the worker at its first merge (`lora_merge.lora_scale`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tidal.config.infer import InferConfig
from tidal.config.orch import OrchConfig
from tidal.config.train import TrainConfig
from tidal.models.shared_weights import QUANTIZATION_ARGS

KEY = "orch weight_broadcast.reload: factors"


def refusal(train: TrainConfig, infer: InferConfig, orch: OrchConfig,
            config: Mapping[str, Any] | None) -> str | None:
    """Why `factors` cannot serve this run's policies (None: it can)."""
    text = (config or {}).get("text_config") or config or {}
    reasons = [
        (not train.lora, "train lora is false: a fully fine-tuned policy has no LoRA factors"),
        (train.qlora_bnb or train.qlora_fp8, "train qlora_bnb / qlora_fp8: the trainer adapts the dequantized "
                                             "quantized base, while vLLM holds the original weights"),
        (train.noise_scheduler.enabled, "train noise_scheduler.enabled (QeRL): its noisy norms reach vLLM only in "
                                        "merged copies or the push"),
        (infer.backend != "vllm", f"infer backend {infer.backend}: the merge runs inside vLLM's worker"),
        (infer.tp > 1, f"infer tp {infer.tp}: a merge into tensor-parallel shards is not verified"),
        (bool((config or {}).get("quantization_config") or text.get("quantization_config"))
         or any(a.split("=")[0] in QUANTIZATION_ARGS for a in infer.extra_args),
         "the model is served quantized (quantization_config / --quantization): its weights take no float sum"),
        (orch.weight_broadcast.type == "nccl", "orch weight_broadcast.type nccl pushes merged weights itself"),
    ]
    return next((why for bad, why in reasons if bad), None)


def factor_updates(train: TrainConfig, infer: InferConfig, orch: OrchConfig,
                   config: Mapping[str, Any] | None) -> tuple[TrainConfig, InferConfig]:
    """(train, infer) for `factors`: no merged copies, the server able to merge; `ConfigError` where it cannot."""
    from tidal.config.load import ConfigError

    why = refusal(train, infer, orch, config)
    if why is not None:
        raise ConfigError(f"{KEY} cannot serve this run: {why}; set orch weight_broadcast.reload to merged (or auto)")
    if train.broadcast_merged and "broadcast_merged" in train.model_fields_set:
        raise ConfigError(f"{KEY} merges the adapter inside vLLM, but train broadcast_merged is true (a merged copy "
                          f"nobody reads); drop it or set reload: merged")
    return (train.model_copy(update={"broadcast_merged": False}),
            infer.model_copy(update={"weight_reload": True}))
