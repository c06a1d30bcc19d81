"""`tidal serve-tinker`: start vLLM, load the base model for training, then serve the Tinker API until stopped.

Start-up order: check the API key, the `tinker` extra and the ports (the server reads the SDK's protobuf messages
with the SDK's own module); start vLLM in the background (`tidal.tinker.sampler`), load the trainer's base model
meanwhile (`tidal.tinker.trainer`), wait for vLLM, then serve with uvicorn. On exit (Ctrl-C, SIGTERM) vLLM is
stopped; a reaper (`tidal.procs.reaper`) kills it too if this process is killed outright.

The served name of the model is what `--model` says, except for a bundled `tidal:NAME`, which is served under its
directory's path: the SDK loads a tokenizer from the base model's name with `AutoTokenizer.from_pretrained`
(after cutting it at the first ':'), and a local directory is a name that works offline. `create_model` also
accepts the `--model` spelling.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.procs import PortInUseError, check_port_free, free_port
from tidal.tinker.config import TinkerServeConfig

log = logging.getLogger("tidal.tinker")


class ServeError(RuntimeError):
    """The server cannot start (the message says why and what to change)."""


def check_sdk() -> None:
    """The `tinker` extra must be installed (its protobuf messages and request models are the wire format)."""
    try:
        import tinker  # noqa: F401
        from tinker.proto import tinker_public_pb2  # noqa: F401
    except ImportError as exc:
        raise ServeError("tidal serve-tinker needs the Tinker SDK: pip install 'tidal[tinker]' (tinker==0.38.0)"
                         f" ({exc})") from None


@dataclass(frozen=True)
class ServedModel:
    """The model `tidal serve-tinker` serves and trains: what the server derives from `--model` at start."""

    model_dir: str
    served_name: str
    architecture: str
    max_context: int
    unembed_ok: bool
    """Whether vLLM gets LoRA layers on the output layer (train_unembed)."""


def served_model(cfg: TinkerServeConfig, sampler_on_cpu: bool) -> ServedModel:
    """The model's directory, served name and what the server needs from its config.json: the context length
    (`--max-model-len`, else the positions the model holds, RoPE factor included: `tidal.models.limits`). The
    lm_head is a LoRA target of vLLM on CPU (checked against PEFT), and on a GPU when the vocabulary is at least the
    hidden size (vLLM 0.24's CUDA warm-up mis-sizes a tied head otherwise: docs/design.md)."""
    from tidal.models.config import read_config, text_config
    from tidal.models.files import is_model_dir
    from tidal.models.limits import max_positions
    from tidal.models.sources import resolve_model

    model_dir = str(Path(resolve_model(cfg.model)).resolve())
    if not is_model_dir(model_dir):
        raise ServeError(f"--model {cfg.model!r}: no config.json in {model_dir}; give a local Hugging Face model "
                         "directory, a Hub id or tidal:tiny-reverse")
    config = read_config(model_dir)
    text = text_config(config)
    limit = max_positions(config)
    max_context = int(cfg.max_model_len or (limit[0] if limit is not None else 2048))
    unembed_ok = sampler_on_cpu or int(text.get("vocab_size", 0)) >= int(text.get("hidden_size", 0))
    served = model_dir if ":" in cfg.model else cfg.model
    return ServedModel(model_dir, served, str((config.get("architectures") or ["?"])[0]), max_context, unembed_ok)


def infer_config(cfg: TinkerServeConfig, port: int) -> Any:
    """The `InferConfig` of the vLLM the server starts (LoRA on, on 127.0.0.1)."""
    from tidal.config.infer import InferConfig, round_lora_rank

    return InferConfig(model=cfg.model, host="127.0.0.1", port=port, enable_lora=True,
                       max_lora_rank=round_lora_rank(cfg.max_lora_rank), max_loras=cfg.max_loras,
                       max_model_len=cfg.max_model_len, cpu_kvcache_space_gib=cfg.cpu_kvcache_space_gib,
                       gpu_memory_utilization=cfg.gpu_memory_utilization, enforce_eager=cfg.enforce_eager)


def sampler_targets(facts: ServedModel) -> list[str]:
    """vLLM's `--lora-target-modules`: every linear module the trainer may adapt, plus the output layer when
    `unembed_ok`."""
    from tidal.models.lora import meta_model
    from tidal.tinker.trainer import module_groups

    groups = module_groups(meta_model(facts.model_dir)[0])
    return sorted(groups["attn"] | groups["mlp"] | (groups["unembed"] if facts.unembed_ok else set()))


def run(cfg: TinkerServeConfig) -> int:
    """Serve until stopped; returns the exit code."""
    try:
        cfg.check_bind()
    except ValueError as exc:
        raise ServeError(str(exc)) from None
    check_sdk()
    from tidal.inference.backends.vllm.server import on_cpu

    vllm_port = cfg.vllm_port or free_port()
    try:
        check_port_free(cfg.host, cfg.port)
        check_port_free("127.0.0.1", vllm_port)
    except PortInUseError as exc:
        raise ServeError(str(exc)) from None
    api_key = cfg.api_key or f"tml-{secrets.token_urlsafe(24)}"
    facts = served_model(cfg, on_cpu())
    cfg.output_dir.mkdir(parents=True, exist_ok=True)

    import uvicorn

    from tidal.procs.reaper import start_reaper
    from tidal.tinker.app import build_app
    from tidal.tinker.sampler import Sampler
    from tidal.tinker.service import TinkerService
    from tidal.tinker.trainer import TrainerHost
    from tidal.trainer.model.load import resolve_device

    start_reaper()  # vLLM's processes die with this one, however it dies
    infer = infer_config(cfg, vllm_port)
    sampler = Sampler(infer, sampler_targets(facts), cfg.output_dir / "vllm.log")
    sampler.start()
    try:
        trainer = TrainerHost(facts.model_dir, resolve_device(cfg.device), micro_batch_tokens=cfg.micro_batch_tokens,
                              unembed_ok=facts.unembed_ok)
        sampler.wait_ready()
        service = TinkerService(facts.served_name, facts.model_dir, facts.architecture, facts.max_context, trainer,
                                sampler, cfg.output_dir, cfg.max_lora_rank, aliases={cfg.model},
                                vllm_model=infer.model, policy_check=cfg.policy_check)
        app = build_app(service, api_key)
        print(f"tidal serve-tinker: serving {facts.served_name} at http://{cfg.host}:{cfg.port}", flush=True)
        print(f"tidal serve-tinker: API key {api_key}" if cfg.api_key is None else
              "tidal serve-tinker: API key as given (--api-key)", flush=True)
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning")
    finally:
        sampler.stop()
    return 0
