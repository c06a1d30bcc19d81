"""Train `share_base_weights` in `tidal grpo`: whether this co-located run can borrow vLLM's base weights (CUDA IPC,
zero-copy; the view plan is `tidal.models.shared_weights`), and the config updates that turn it on.

`refusal` names why it cannot (the device, the trainer's and vLLM's settings, the architecture); `apply_sharing`
turns train `share_base_weights: auto` on where nothing refuses it and refuses `true` with the reason
(docs/colocate.md).
"""

from __future__ import annotations

from tidal.config.infer import InferConfig
from tidal.config.load import ConfigError
from tidal.config.orch import OrchConfig
from tidal.config.train import TrainConfig
from tidal.models.shared_weights import QUANTIZATION_ARGS, VERIFIED, train_refusal


def refusal(train: TrainConfig, infer: InferConfig, orch: OrchConfig, device: str,
            architecture: str | None) -> str | None:
    """Why the base weights cannot be shared in this co-located run (None: they can). `train` / `infer` / `orch`:
    the derived `TrainConfig` / `InferConfig` / `OrchConfig`; `device`: `cuda` or `cpu`; `architecture`: the
    model's (config.json), None when unknown. Pure: the caller turns a reason into exit 2 (`true`) or a notice
    (`auto`)."""
    wb = orch.weight_broadcast
    if device != "cuda":
        return "CUDA IPC needs the trainer and vLLM on the same NVIDIA GPU (this run is CPU-only)"
    if (why := train_refusal(train)) is not None:
        return why
    reasons = [
        (infer.dtype not in ("auto", "bfloat16"), f"infer dtype {infer.dtype}: the trainer runs a bfloat16 base"),
        (infer.tp > 1 or infer.dp > 1,
         f"infer tp {infer.tp} / dp {infer.dp}: sharing maps one unsharded vLLM worker to one trainer rank (tp 1, "
         f"dp 1, gpus 1)"),
        (any(a.split("=")[0] in QUANTIZATION_ARGS for a in infer.extra_args),
         "infer extra_args quantize vLLM's base (--quantization): its quantized layout is kernel-specific and "
         "not viewable as the trainer's projections"),
        (wb.type == "nccl" or wb.reload in ("merged", "factors"),
         f"orch weight_broadcast (type {wb.type}, reload {wb.reload}) writes merged weights into vLLM's base, "
         f"which the trainer's frozen base would then see; sharing needs LoRA adapters (reload lora/auto)"),
    ]
    if (why := next((why for bad, why in reasons if bad), None)) is not None:
        return why
    if architecture is None:
        return "the model's architecture is unknown (no config.json architectures)"
    if architecture not in VERIFIED:
        return (f"architecture {architecture}: its vLLM weight layout is not verified for sharing (verified: "
                f"{', '.join(sorted(VERIFIED))})")
    return None


def apply_sharing(train: TrainConfig, infer: InferConfig, orch: OrchConfig, device: str, architecture: str | None,
                  url: str) -> tuple[TrainConfig, InferConfig, str | None]:
    """(train, infer, notice): train `share_base_weights` `auto` becomes true where `refusal` finds nothing (else
    it stays, meaning off, with a notice on a GPU); `true` where it finds something raises `ConfigError` (exit 2)
    with the reason.
    On: the trainer asks the vLLM server at `url` for its handles (train `base_weights_url`), vLLM starts with
    tidal's worker extension (infer `export_base_weights`)."""
    setting = train.share_base_weights
    if setting is False:
        return train, infer, None
    why = refusal(train, infer, orch, device, architecture)
    if why is not None:
        if setting is True:
            raise ConfigError(f"train share_base_weights is true but the base weights cannot be shared: {why}; set "
                              f"share_base_weights: auto (on where it applies) or false")
        note = f"GPU: base weights not shared with vLLM ({why})" if device == "cuda" else None
        return train, infer, note  # `auto` stays: the trainer reads anything but true as its own copy
    return (train.model_copy(update={"share_base_weights": True, "base_weights_url": url}),
            infer.model_copy(update={"export_base_weights": True}),
            "GPU: base weights shared with vLLM (CUDA IPC, zero-copy: the trainer's frozen base is vLLM's tensors); "
            "an inference restart would invalidate them, so the inference server is not restarted")
