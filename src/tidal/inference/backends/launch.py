"""`tidal grpo-infer`: start the servers of infer `backend` (`backends.vllm.server` or `backends.sglang.server`)."""

from __future__ import annotations

from tidal.config.infer import InferConfig


def serve(cfg: InferConfig) -> int:
    """With dp 1, become the server (does not return); with dp N, supervise N servers and return the exit code.
    Raises the backend's start-up errors (`PortInUseError`, `InsecureBindError`, `PlacementError`, `ConfigError`)
    before anything starts."""
    if cfg.backend == "sglang":
        from tidal.inference.backends.sglang.server import serve as serve_sglang

        return serve_sglang(cfg)
    from tidal.inference.backends.vllm.server import serve as serve_vllm

    return serve_vllm(cfg)
