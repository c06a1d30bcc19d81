"""The trainer's frozen base built from vLLM's own weight tensors (train `share_base_weights`, docs/colocate.md).

`load_shared_base(cfg, device, dtype)`: ask the co-located vLLM server (`cfg.base_weights_url`) for the CUDA
IPC handles of its parameters (`tidal.inference.backends.vllm.worker_ext`, through `POST /collective_rpc`), open
them on this process's index of the same GPU (`tidal.inference.backends.vllm.ipc`), and `build_from_tensors`: the
Hugging Face model is built on the meta device (no memory), each shared parameter becomes a view of vLLM's tensor as
`tidal.models.shared_weights.view_plan` says (`qkv_proj.narrow(0, start, length)` for `q_proj`, ...), the
unshared ones (norms) are read from the checkpoint, the non-persistent buffers (RoPE frequencies, Gemma's
embedding scale) are computed by transformers' own `_init_weights` before any shared tensor is attached, so
nothing is ever written into vLLM's memory. Shared parameters do not require grad; LoRA (PEFT) wraps the
modules as usual and QeRL's noise acts on the norms, which are the trainer's own copies.

A check (`check_against_checkpoint`) compares the shared views of the first decoder layer and the embeddings
with the checkpoint, so a layout vLLM changed after loading (a kernel-specific repack) stops the run with the
names instead of training on scrambled weights.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tidal.config.load import ConfigError
from tidal.config.train import TrainConfig
from tidal.models.families import has_linear_attention
from tidal.models.shared_weights import SharePlan, SharingRefused, train_refusal, view_plan

log = logging.getLogger(__name__)

RPC_METHOD = "tidal_export_base"


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of the checkpoint in `model_dir` (single file or sharded index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{model_dir}: no model.safetensors(.index.json); shared base weights read the "
                                f"unshared tensors from a safetensors checkpoint")
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 - safe_open has keys(), no iteration


def read_tensors(files: Mapping[str, Path], names: list[str]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors `names` (each file opened once)."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name in names:
        if name not in files:
            raise KeyError(f"tensor {name} is not in the checkpoint")
        by_file.setdefault(files[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for path, group in by_file.items():
        with safe_open(str(path), "pt") as f:
            out.update({n: f.get_tensor(n) for n in group})
    return out


def _init_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Materialize the buffers (on meta after the meta build) on `device` and let transformers compute them
    (`_init_weights` of their module: RoPE frequencies, Gemma's embedding scale) while the module's parameters
    are still on meta, so that no initializer can touch a shared tensor."""
    owners = set()
    for name, buf in list(model.named_buffers()):
        if buf.device.type != "meta":
            continue
        mod_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(mod_name)
        module._buffers[leaf] = torch.empty_like(buf, device=device)
        owners.add(mod_name)
    init = getattr(model, "_init_weights", None)
    if owners and init is None:
        raise RuntimeError(f"{type(model).__name__} has no _init_weights to compute its buffers")
    with torch.no_grad():
        for mod_name in sorted(owners):
            init(model.get_submodule(mod_name))  # type: ignore[misc]


def _set_param(model: torch.nn.Module, names: list[str], param: torch.nn.Parameter) -> None:
    for name in names:  # tied parameters: the same Parameter under each name
        mod_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(mod_name), leaf, param)


def build_from_tensors(config: Any, model_cls: Any, vllm: Mapping[str, torch.Tensor], model_dir: Path,
                       device: torch.device, dtype: torch.dtype, attn: str) -> tuple[torch.nn.Module, SharePlan]:
    """The Hugging Face model of `config` whose shared parameters are views of `vllm` (vLLM's tensors by name,
    already on `device`) and whose unshared ones come from the checkpoint in `model_dir`; and the plan used.
    Raises `SharingRefused` for a layout the plan does not know or tensors of another dtype than `dtype`."""
    architecture = str((getattr(config, "architectures", None) or [type(config).__name__])[0])
    with torch.device("meta"):
        model = model_cls.from_config(config, dtype=dtype, attn_implementation=attn)
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    hf_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    plan = view_plan(architecture, hf_shapes, {n: tuple(t.shape) for n, t in vllm.items()})
    wrong = sorted({f"{v.vllm_name} ({vllm[v.vllm_name].dtype})" for v in plan.shared.values()
                    if vllm[v.vllm_name].dtype != dtype})
    if wrong:
        raise SharingRefused(f"vLLM serves the base in another dtype than the trainer's {dtype}: {', '.join(wrong[:3])}"
                             f"; serve it in bfloat16 (infer dtype: bfloat16) or set train share_base_weights: false")
    _init_buffers(model, device)
    params = dict(model.named_parameters())
    for name, view in plan.shared.items():
        tensor = vllm[view.vllm_name].narrow(view.dim, view.start, view.length)
        if tuple(tensor.shape) != hf_shapes[name]:
            raise SharingRefused(f"{name}: view {tuple(tensor.shape)} != {hf_shapes[name]}")
        _set_param(model, aliases[id(params[name])], torch.nn.Parameter(tensor, requires_grad=False))
    own = read_tensors(checkpoint_files(model_dir), list(plan.unshared))
    for name in plan.unshared:
        value = own[name].to(device=device, dtype=dtype)
        _set_param(model, aliases[id(params[name])], torch.nn.Parameter(value))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise SharingRefused(f"{architecture}: tensors left unbuilt: {', '.join(left[:5])}")
    return model, plan


def _expert_pieces(name: str, view: torch.Tensor) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the part of a fused expert tensor (transformers 5: `mlp.experts.gate_up_proj`
    (E, 2I, H) = per expert cat(gate, up); `mlp.experts.down_proj` (E, H, I)) that holds it, for expert 0."""
    prefix = name.rsplit(".", 1)[0]  # ...mlp.experts
    if name.endswith("experts.gate_up_proj"):
        inter = view.shape[1] // 2
        return {f"{prefix}.0.gate_proj.weight": view[0, :inter], f"{prefix}.0.up_proj.weight": view[0, inter:]}
    if name.endswith("experts.down_proj"):
        return {f"{prefix}.0.down_proj.weight": view[0]}
    return {}


def check_against_checkpoint(model: torch.nn.Module, plan: SharePlan, model_dir: Path) -> int:
    """Compare the shared views of decoder layer 0 (for experts: expert 0) and the embeddings with the checkpoint
    (cast to the view's dtype, as vLLM cast it when loading); returns how many tensors were compared. Raises
    `SharingRefused` naming the first that differs (vLLM changed its layout after loading)."""
    files = checkpoint_files(model_dir)
    params = dict(model.named_parameters())
    pieces: dict[str, tuple[str, torch.Tensor]] = {}
    for name in plan.shared:
        if ".layers.0." not in name and "embed_tokens" not in name:
            continue
        view = params[name].detach()
        for disk_name, part in ({name: view} if name in files else _expert_pieces(name, view)).items():
            if disk_name in files:
                pieces[disk_name] = (name, part)
    for disk_name, disk in read_tensors(files, list(pieces)).items():
        name, mine = pieces[disk_name]
        if not torch.equal(mine, disk.to(device=mine.device, dtype=mine.dtype)):
            raise SharingRefused(f"shared weight {name} (vLLM's {plan.shared[name].vllm_name}) differs from the "
                                 f"checkpoint's {disk_name}: vLLM keeps it in a layout tidal does not know; set "
                                 f"train share_base_weights: false")
    return len(pieces)


def fetch_handles(url: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """The worker's `tidal_export_base` answer from the vLLM server at `url` (`http://host:port/v1`)."""
    import os

    import httpx

    root = url.removesuffix("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {key}"} if (key := os.environ.get("VLLM_API_KEY")) else {}
    resp = httpx.post(f"{root}/collective_rpc", json={"method": RPC_METHOD}, headers=headers, timeout=timeout_s)
    if resp.status_code == 404:
        raise ConfigError(f"{root} has no /collective_rpc: start vLLM with infer export_base_weights: true (tidal "
                          f"grpo sets it when share_base_weights resolves on)")
    resp.raise_for_status()
    results = resp.json()["results"]
    if len(results) != 1:
        raise SharingRefused(f"{root} answered for {len(results)} workers; sharing needs exactly one (tp 1)")
    return dict(results[0])


def open_handles(export: Mapping[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """vLLM's tensors from a `tidal_export_base` answer, opened on `device`, which must be the same physical GPU
    (by UUID) as vLLM's."""
    from tidal.inference.backends.vllm.ipc import decode, local_index

    index = local_index(str(export["gpu_uuid"]))
    if index is None or (device.index if device.index is not None else torch.cuda.current_device()) != index:
        raise SharingRefused(f"vLLM's weights are on GPU {export['gpu_uuid']}, which is not the trainer's device "
                             f"{device} (this process sees it as {'no device' if index is None else f'cuda:{index}'}"
                             f"); CUDA IPC shares memory on one GPU")
    return {name: decode(entry, index) for name, entry in export["tensors"].items()}


def load_shared_base(cfg: TrainConfig, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The trainer's base model built from the co-located vLLM's weights (see the module docstring). Raises
    `ConfigError` (exit 2) when `share_base_weights` is on without a server to share with, or when the layout,
    dtype or device rules it out."""
    from tidal.trainer.model.hf import attn_implementation, auto_model_class, check_model_dir, load_model_config

    if not cfg.base_weights_url:
        raise ConfigError("train share_base_weights is true but base_weights_url is unset: sharing vLLM's weights "
                          "is set up by `tidal grpo` (co-located on one GPU); with grpo-train alone set "
                          "share_base_weights: false (or auto)")
    if device.type != "cuda":
        raise ConfigError(f"train share_base_weights: the trainer runs on {device}; CUDA IPC needs a GPU")
    if (why := train_refusal(cfg)) is not None:
        raise ConfigError(f"train share_base_weights is true but {why}; set share_base_weights: false")
    config = load_model_config(cfg.model, cfg.trust_remote_code, cfg.rope_scaling)
    model_dir = check_model_dir(cfg.model)
    try:
        tensors = open_handles(fetch_handles(cfg.base_weights_url), device)
        model, plan = build_from_tensors(config, auto_model_class(config, cfg.model), tensors, model_dir, device,
                                         dtype, attn_implementation(device, cfg.attention,
                                                             linear=has_linear_attention(config)))
        checked = check_against_checkpoint(model, plan, model_dir)
    except SharingRefused as exc:
        raise ConfigError(f"train share_base_weights: {exc}") from None
    shared = sum(tensors[n].numel() * tensors[n].element_size() for n in plan.vllm_names())
    log.info("base weights shared with vLLM: %d parameters as views of %d vLLM tensors (%.2f GiB not copied), %d "
             "own (norms); %d checked against the checkpoint", len(plan.shared), len(plan.vllm_names()),
             shared / 2**30, len(plan.unshared), checked)
    return model
