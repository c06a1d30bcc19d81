"""What a local model directory holds, by its files (torch-free): the one "is this a model directory?" test and the
one weights check.

- `is_model_dir(path)`: the directory holds a `config.json` (what transformers and vLLM read first). Every place
  that asks whether a name resolved to a model directory asks this (`tidal.models.arch.check_model`, the trainer's
  `check_model_dir`, the reward model, `tidal serve-tinker`, `tidal.models.config`).
- `weight_files(path)` / `missing_weights(path)`: the weights transformers' `from_pretrained` and vLLM load:
  `*.safetensors` (one file or the shards `model.safetensors.index.json` names), else `*.bin` / `*.pt` (PyTorch
  files, the shards `pytorch_model.bin.index.json` names). A directory with config.json and a tokenizer but no
  weights would pass every config check, start vLLM and then end the trainer with transformers' `OSError: Error
  no file named model.safetensors`; `check_weights` refuses it up front (`ConfigError`, exit 2), naming the
  directory and the files it looked for. A Hugging Face Hub id is left alone: `models.sources.hub` only uses a snapshot
  whose safetensors weights are complete.
"""

from __future__ import annotations

import json
from pathlib import Path

from tidal.config.load import ConfigError

CONFIG_FILE = "config.json"
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
"""Weight files, in the order the loaders prefer them."""
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
"""Sharded weights: the index names every shard (`weight_map`), each of which must be there."""
LOOKED_FOR = ", ".join([*WEIGHT_PATTERNS, *INDEX_FILES])
"""What `check_weights` names when none is there."""


def is_model_dir(path: str | Path) -> bool:
    """`path` is a model directory: it holds a config.json."""
    return (Path(path) / CONFIG_FILE).is_file()


def missing_weights(path: str | Path) -> str | None:
    """Why the model directory `path` holds no complete weights (None: it does): no weight file at all, or shards
    its index names that are not there."""
    p = Path(path)
    for index in INDEX_FILES:
        if (p / index).is_file():
            try:
                shards = sorted(set(json.loads((p / index).read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                return f"its {index} cannot be read ({type(exc).__name__}: {exc})"
            absent = [s for s in shards if not (p / s).is_file()]
            if absent:
                more = ", ..." if len(absent) > 3 else ""
                return (f"{len(absent)} of the {len(shards)} shards its {index} names are missing "
                        f"({', '.join(absent[:3])}{more})")
            return None
    if weight_files(p):
        return None
    return f"no weight files ({LOOKED_FOR})"


def weight_files(path: str | Path) -> list[Path]:
    """The weight files directly in `path` (`WEIGHT_PATTERNS`), sorted."""
    p = Path(path)
    return sorted(f for pattern in WEIGHT_PATTERNS for f in p.glob(pattern) if f.is_file())


def is_local(model: str) -> bool:
    """`model` names a local directory (a bundled `tidal:NAME` or an existing path), not a Hub id."""
    from tidal.assets import PREFIX

    return model.startswith(PREFIX) or Path(model).expanduser().is_dir()


def check_weights(model: str, path: str | Path, source: str) -> None:
    """Refuse the local model directory `path` (what `model` names; `source`: the file and key that name it) when
    it holds no complete weights (`missing_weights`); a Hub id (`is_local` false) passes."""
    if not is_local(model) or not is_model_dir(path):
        return
    why = missing_weights(path)
    if why is not None:
        where = Path(path).resolve()
        named = "" if Path(model).expanduser().resolve() == where else f" ('{model}')"
        raise ConfigError(f"{source}: model directory {where}{named} holds a config.json but "
                          f"{why}: transformers and vLLM would fail loading it after the run started; copy the "
                          f"weights there (model.safetensors, or the shards with their index), or name a complete "
                          f"model directory or a Hub id")
