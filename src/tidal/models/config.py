"""One reader of a model's config.json, and the one `text_config` rule (torch-free).

`read_config(model_dir)` reads a model directory's config.json; `model_config(model)` first resolves a model name
(`tidal:NAME`, a local directory or a cached Hub id, `tidal.models.sources.resolve_model`). `text_config(config)` is the
language model's part of a config: a vision-language model's `text_config` (a non-empty mapping), else the config
itself; every length, width, vocabulary and expert count tidal reads comes through it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tidal.models.files import CONFIG_FILE, is_model_dir
from tidal.models.sources import resolve_model


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """The config.json of the model directory `model_dir` as a dict (FileNotFoundError / ValueError as json raises)."""
    config: dict[str, Any] = json.loads((Path(model_dir) / CONFIG_FILE).read_text())
    return config


def model_config(model: str, missing_ok: bool = False) -> dict[str, Any]:
    """The config.json of the model `model` names (resolved first); `missing_ok`: {} when the directory has none."""
    path = Path(resolve_model(model))
    if missing_ok and not is_model_dir(path):
        return {}
    return read_config(path)


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config.json dict: a VLM's `text_config`, else the dict itself."""
    text = config.get("text_config")
    return text if isinstance(text, Mapping) and text else config
