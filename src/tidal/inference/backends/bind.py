"""The engines' API-key rule: an inference server (vLLM, SGLang) that binds beyond loopback must require an API key,
all the more when its dev routes run methods in the engine (weight reloads, NCCL broadcasts, base-weight exports).
Checked before anything starts (`tidal grpo-infer`, `tidal grpo`); `InsecureBindError` ends the command with exit 2."""

from __future__ import annotations

import os
from typing import Protocol

from tidal.procs import LOOPBACK, bind_host


class InsecureBindError(RuntimeError):
    """Binding beyond loopback without an API key."""


class ServerAddress(Protocol):
    """The infer config keys `check_bind_secure` reads (`tidal.config.infer.InferConfig` has them)."""

    @property
    def host(self) -> str | None: ...
    @property
    def extra_args(self) -> list[str]: ...
    @property
    def weight_reload(self) -> bool: ...
    @property
    def weight_broadcast_type(self) -> str: ...
    @property
    def export_base_weights(self) -> bool: ...


def check_bind_secure(cfg: ServerAddress) -> None:
    """Beyond loopback the server must require an API key (VLLM_API_KEY or `--api-key` in extra_args)."""
    host = bind_host(cfg.host)
    if host in LOOPBACK or os.environ.get("VLLM_API_KEY") or "--api-key" in cfg.extra_args:
        return
    dev = cfg.weight_reload or cfg.weight_broadcast_type == "nccl" or cfg.export_base_weights
    mode = (" with weight_reload, export_base_weights or nccl weight broadcasts (their dev routes run methods in the "
            "engine)") * dev
    raise InsecureBindError(f"host {host}: refusing to serve beyond localhost without an API key{mode}; set the "
                            f"VLLM_API_KEY environment variable (clients read it too: client.api_key_var) or "
                            f"bind to 127.0.0.1 (host: null)")
