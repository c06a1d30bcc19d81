"""The inference backends behind `tidal.inference.protocol.InferenceClient`: vLLM (`backends.vllm`) and SGLang
(`backends.sglang`), each a server launcher (`tidal grpo-infer`) and a client. This module picks the client from orch
`client.backend` (`launch` picks the server from infer `backend`); it imports no engine and no torch."""

from __future__ import annotations

from tidal.config.orch import ClientSection
from tidal.inference.protocol import InferenceClient


def make_client(cfg: ClientSection) -> InferenceClient:
    """The client for the servers `cfg` names, speaking their backend's API (`client.backend`)."""
    if cfg.backend == "sglang":
        from tidal.inference.backends.sglang.client import SglangClient

        return SglangClient(cfg)
    from tidal.inference.backends.vllm.client import VllmClient

    return VllmClient(cfg)

