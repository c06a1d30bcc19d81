"""What `tidal eval` scores: the base model and each adapter, resolved and checked before vLLM starts.

An adapter argument is a PEFT directory (`adapter_config.json` + `adapter_model.safetensors`), a run directory
(its `final/adapter`, else its newest published policy `broadcasts/step_N`), or a trainer checkpoint
(`checkpoints/trainer/step_N`: its `adapter/`). Each is checked against the model on the meta device (no weights
read): every LoRA tensor must name a module of the model whose shape it fits, so an adapter trained on another base
(or a rank the shapes contradict) is refused with exit 2 naming the file, before any server starts. So is what
vLLM's LoRA loader cannot serve as trained (`UNSERVED`: DoRA, `modules_to_save`; any tensor besides lora_A/B).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from tidal.config.load import ConfigError
from tidal.paths import broadcasts_dir, final_dir, stable_steps

LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
"""A PEFT adapter tensor: `base_model.model.<module>.lora_A.weight` (or with the adapter's name before `.weight`)."""


UNSERVED = {
    "use_dora": "vLLM's LoRA layers have no DoRA magnitude vectors, so its rows would score another model than the "
                "one trained (merge it into the base with PEFT's merge_and_unload and evaluate that directory as "
                "--model)",
    "modules_to_save": "vLLM loads no fully trained modules beside the LoRA matrices (it refuses the adapter when it "
                       "is loaded); merge it into the base with PEFT's merge_and_unload and evaluate that directory "
                       "as --model"}
"""adapter_config.json keys whose adapters vLLM cannot serve as trained (refused with the reason, exit 2)."""


@dataclass(frozen=True)
class Target:
    """One row of the report: the base model, or one adapter on it."""

    label: str
    """How the row is named (the argument as given; `base` for the base model)."""
    adapter: Path | None
    """The PEFT directory (None: the base model)."""
    rank: int = 0
    """The adapter's LoRA rank (`r`)."""
    modules: tuple[str, ...] = ()
    """Leaf names of the modules it adapts (`q_proj`, ...), for vLLM's `--lora-target-modules`."""


def adapter_dir(arg: str) -> Path:
    """The PEFT directory `arg` names (module docs); ConfigError naming what was looked for."""
    path = Path(arg)
    candidates = [path, final_dir(path, "adapter"), path / "adapter"]
    steps = stable_steps(broadcasts_dir(path)) if (path / "broadcasts").is_dir() else []
    if steps:
        candidates.append(broadcasts_dir(path) / f"step_{steps[-1]}")
    for c in candidates:
        if (c / "adapter_config.json").is_file():
            return c
    if not path.exists():
        raise ConfigError(f"adapter {arg}: no such file or directory")
    raise ConfigError(f"adapter {arg}: not a PEFT adapter directory, run directory (final/adapter, broadcasts/step_N) "
                      f"or checkpoint (adapter/): no adapter_config.json found there")


def adapter_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of `directory`'s adapter weights (safetensors header only)."""
    from safetensors import safe_open

    weights = directory / "adapter_model.safetensors"
    if not weights.is_file():
        raise ConfigError(f"adapter {directory}: no adapter_model.safetensors (a .bin adapter is pickle: refused)")
    with safe_open(str(weights), framework="np") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - safe_open has no iter


def check_adapter(label: str, directory: Path, model_dir: str) -> Target:
    """The adapter at `directory` as a `Target`, after checking each LoRA tensor against the model's modules."""
    config = json.loads((directory / "adapter_config.json").read_text())
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ConfigError(f"adapter {label}: peft_type {config.get('peft_type')!r}; tidal eval serves LoRA adapters")
    for key, why in UNSERVED.items():
        if config.get(key):
            raise ConfigError(f"adapter {label}: adapter_config.json sets {key}={config[key]!r}; {why}")
    rank = int(config.get("r", 0))
    modules = meta_linear_shapes(model_dir)
    leaves: set[str] = set()
    for key, shape in adapter_shapes(directory).items():
        m = LORA_KEY.match(key)
        if m is None:  # vLLM would drop it (a DoRA magnitude, a saved module): another model than trained
            raise ConfigError(f"adapter {label}: its tensor {key} is no LoRA A/B matrix; vLLM serves lora_A / "
                              f"lora_B only, so the adapter cannot be scored as trained")
        name = m["module"]
        if name not in modules:
            raise ConfigError(f"adapter {label}: its tensor {key} adapts {name}, which the model {model_dir} does not "
                              f"have (trained on another base model?)")
        out_f, in_f = modules[name]
        want = (rank, in_f) if m["ab"] == "A" else (out_f, rank)
        if shape != want:
            raise ConfigError(f"adapter {label}: {key} has shape {list(shape)}, the model's {name} with rank {rank} "
                              f"needs {list(want)} (another base model, or adapter_config.json's r is wrong)")
        leaves.add(name.rsplit(".", 1)[-1])
    if not leaves:
        raise ConfigError(f"adapter {label}: {directory / 'adapter_model.safetensors'} holds no LoRA tensors")
    return Target(label, directory, rank, tuple(sorted(leaves)))


_SHAPES: dict[str, dict[str, tuple[int, int]]] = {}


def meta_linear_shapes(model_dir: str) -> dict[str, tuple[int, int]]:
    """Module name -> (out_features, in_features) of every linear layer of the model built on the meta device."""
    if model_dir not in _SHAPES:
        import torch

        from tidal.models.lora import meta_model

        model, _ = meta_model(model_dir)
        _SHAPES[model_dir] = {name: (m.out_features, m.in_features) for name, m in model.named_modules()
                              if isinstance(m, torch.nn.Linear)}
    return _SHAPES[model_dir]


def resolve_targets(model_dir: str, adapters: list[str], base: bool) -> list[Target]:
    """The rows to score, in order: the base model (when `base`), then each adapter, checked."""
    rows = [Target("base", None)] if base else []
    seen: set[Path] = set()
    for arg in adapters:
        d = adapter_dir(arg).resolve()
        if d in seen:
            raise ConfigError(f"adapter {arg}: given twice ({d})")
        seen.add(d)
        rows.append(check_adapter(arg, d, model_dir))
    return rows
