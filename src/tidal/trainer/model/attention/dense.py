"""The dense-mask fallback (train `attention: dense`): transformers' own SDPA attention with the (B, 1, T, T) boolean
mask transformers builds for packed rows (or the packer's layout mask with shared prompts).

A kernel given a mask computes every one of the T x T scores, the causal half and the other samples' blocks
included: on a 16,384-token row of 16 samples that is 22x flex_attention's cost on an H100 (issue 27). It is
what the trainer ran on CUDA before `tidal.trainer.model.attention.flex`, it reads every mask transformers can build,
and it is the reference the other kernels are tested against; choosing it says so once in the log.
"""

from __future__ import annotations

import logging

log = logging.getLogger("tidal.trainer")

NAME = "sdpa"
"""transformers' attention implementation name for it (nothing to register)."""


def notice(device: str) -> None:
    """The one line that says the dense kernel was chosen and what it costs."""
    log.info("attention dense on %s: SDPA with a dense (T, T) mask per packed row computes all T² scores "
             "(attention auto picks %s here)", device, "flex" if device == "cuda" else "per_sample")
