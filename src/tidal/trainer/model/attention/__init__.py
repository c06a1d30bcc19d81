"""Attention of packed rows, per device: which kernel computes it, chosen in one place (`implementation`).

Kernels (train `attention`), each equal to the dense masked computation by test (tests/unit/test_attention*.py,
test_packed_attention.py, test_prompt_sharing.py):
- `per_sample` (`per_sample.py`): one causal SDPA call per sample of a row (and per shared-prompt suffix); the
  CPU default (PyTorch's CPU kernels have no variable-length or block-sparse attention with a backward).
- `flex` (`flex.py`): torch's flex_attention with a block mask of the row layout, compiled at most twice (with
  and without autograd) per size bucket of a micro-batch's rows x width (`flex.graph_budget`); the CUDA
  default. Refused on CPU (no flex backward there).
- `dense` (`dense.py`): transformers' SDPA with the (B, 1, T, T) mask; computes all T² scores. Only when asked
  (or per call where the others do not apply; they say so).
`auto`: `flex` on CUDA and `per_sample` on CPU; vision-language models keep `per_sample` everywhere (their
vision towers run non-causal attention that the per-sample kernel hands to SDPA unchanged, a path tested on
CPU). The row layout all of them read is `layout.py`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tidal.trainer.model.attention import dense, flex, per_sample
from tidal.trainer.model.attention.layout import Span, layout, layout_mask, segments, spans_mask, token_layout
from tidal.trainer.profile import ATTENTION

__all__ = ["ATTN_IMPLEMENTATION", "KINDS", "Span", "choose", "flat_rows_blocker", "implementation", "layout",
           "layout_mask", "prompt_sharing_blocker", "register", "segments", "spans_mask", "token_layout", "uses_flex"]

ATTN_IMPLEMENTATION = per_sample.NAME
"""The per-sample kernel's transformers name (what `register()` returns)."""
KINDS = ("auto", "flex", "per_sample", "dense")
"""Values of train `attention`."""
FLEX_ON_CPU = ("train attention 'flex' needs CUDA: torch's flex_attention has no backward on CPU (torch "
               f"{torch.__version__.split('+')[0]}); use auto or per_sample there")


FLEX_LINEAR = ("train attention 'flex' does not fit a model with linear-attention layers: transformers hands them "
               "the attention mask, which they cannot read as flex's block mask, and such a model is packed one "
               "sample per row anyway (tidal.models.families); use auto or per_sample")


def choose(kind: str, device: torch.device, vision: bool = False, linear: bool = False) -> str:
    """train `attention` -> the kernel that runs (`auto` resolved per device; module doc). Raises ValueError for
    `flex` on CPU (`FLEX_ON_CPU`), for `flex` on a model with linear-attention layers (`linear`: `FLEX_LINEAR`;
    `auto` takes per_sample there) and for an unknown kind."""
    if kind not in KINDS:
        raise ValueError(f"train attention '{kind}' is not one of {', '.join(KINDS)}")
    if kind == "auto":
        return "flex" if device.type == "cuda" and not vision and not linear else "per_sample"
    if kind == "flex" and device.type != "cuda":
        raise ValueError(FLEX_ON_CPU)
    if kind == "flex" and linear:
        raise ValueError(FLEX_LINEAR)
    return kind


def _labelled(kernel: Any) -> Any:
    """`kernel` inside the profiler's `ATTENTION` range (`tidal.trainer.profile`'s attention rows)."""
    @functools.wraps(kernel)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(ATTENTION):
            return kernel(*args, **kwargs)

    return run


def register(kind: str = "per_sample") -> str:
    """Make kernel `kind` known to transformers (attention and mask interfaces; idempotent) and return the name for
    `from_pretrained(attn_implementation=...)`."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    if kind == "dense":
        return dense.NAME
    if kind == "flex":
        AttentionInterface.register(flex.NAME, _labelled(flex.flex_packed_attention))
        AttentionMaskInterface.register(flex.NAME, flex.flex_mask)
        return flex.NAME
    AttentionInterface.register(per_sample.NAME, _labelled(per_sample.packed_sdpa_attention))
    AttentionMaskInterface.register(per_sample.NAME, sdpa_mask)
    return per_sample.NAME


def implementation(kind: str, device: torch.device, vision: bool = False, linear: bool = False) -> str:
    """train `attention` on `device` -> the registered transformers attention implementation (`choose`); a dense
    choice says once what it costs."""
    chosen = choose(kind, device, vision, linear)
    if chosen == "dense":
        dense.notice(device.type)
    return register(chosen)


def uses_flex(model: Any) -> bool:
    """Whether `model` (a transformers model, PEFT-wrapped or not) runs the flex kernel."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == flex.NAME


def prompt_sharing_blocker(config: Any, sequence_len: int) -> str | None:
    """Why rows of a model with this transformers `config` cannot share prompts (None: they can). The shared
    layout reaches the model as one 4D boolean mask (`layout_mask`), which transformers hands unchanged to every
    layer: a sliding-window layer would lose its window (fine only when the window covers `sequence_len`), and
    only SDPA-style attention reads a boolean mask (tidal's own kernels, SDPA; not eager's additive masks nor
    flash-attention, which reads none). Vision-language models are left out (their image features sit on prompt
    tokens)."""
    from tidal.models.families import has_linear_attention

    if getattr(config, "vision_config", None) is not None:
        return "it is a vision-language model"
    if has_linear_attention(config):
        return ("it has linear-attention layers (a recurrent state and a convolution window run along the row, "
                "so its samples are packed one per row: tidal.models.families)")
    window = _window(config)
    if window is not None and window < sequence_len:
        return f"its sliding-window layers ({window} tokens) are shorter than train sequence_len ({sequence_len})"
    impl = getattr(config, "_attn_implementation", None)
    if impl not in (None, dense.NAME, per_sample.NAME, flex.NAME):
        return f"its attention implementation {impl!r} does not take a boolean attention mask"
    return None


def _window(config: Any) -> int | None:
    """The sliding window of the model's windowed layers (None: no such layer)."""
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None) or []
    windowed = (getattr(config, "use_sliding_window", True) is not False
                and (not kinds or "sliding_attention" in kinds))
    return int(window) if window is not None and windowed else None


def flat_rows_blocker(config: Any, width: int) -> str | None:
    """Why a model with this transformers `config` should keep padded rows rather than one flat row of up to `width`
    tokens per micro-batch (`tidal.trainer.step.packing`'s `flat`; None: flat rows fit). Flat rows pay only where
    the attention costs the same whatever the row holds: tidal's per-sample kernel, and only where it runs (it
    hands a soft-capped layer, or a sliding window shorter than the row, to SDPA over the whole row, T² scores).
    Models with linear-attention layers (one sample per row) and vision-language models are left out."""
    from tidal.models.families import has_linear_attention

    if getattr(config, "_attn_implementation", None) != per_sample.NAME:
        return "its attention kernel is not tidal's per-sample one"
    if getattr(config, "vision_config", None) is not None:
        return "it is a vision-language model"
    if has_linear_attention(config):
        return "it has linear-attention layers (one sample per row)"
    if getattr(config, "attn_logit_softcapping", None):
        return "its attention soft-caps its logits (the per-sample kernel hands such layers to SDPA)"
    window = _window(config)
    if window is not None and window < width:
        return f"its sliding-window layers ({window} tokens) are shorter than a flat row ({width})"
    return None
