"""Read a YAML config file, apply dotted CLI overrides, validate, and explain every mistake.

`load_config(TrainConfig, "train.yaml", {"loss.kl_tau": "0.1"})` returns a validated model or raises
`ConfigError`, whose message names the file, each offending key (dotted), what was wrong and, for unknown
keys, the nearest valid key. The CLI turns `ConfigError` into exit code 2.
"""

from __future__ import annotations

import difflib
import logging
import typing
import warnings
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from tidal.config.base import ConfigWarning

M = TypeVar("M", bound=BaseModel)
log = logging.getLogger("tidal.config")


class ConfigError(Exception):
    """A config file or override is invalid; the message is meant for the user as is."""


def parse_scalar(text: str) -> Any:
    """Parse an override value the way YAML would (`32` -> int, `[a, b]` -> list, `null` -> None)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set `a.b.c = value` for each dotted key, creating nested dicts as needed (returns a new dict)."""
    out = dict(data)
    for dotted, value in overrides.items():
        node = out
        parts = dotted.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        node[parts[-1]] = parse_scalar(value) if isinstance(value, str) else value
    return out


def _model_at(cls: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the last element of `loc` (None if it cannot be resolved)."""
    model: type[BaseModel] = cls
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        found = None
        for candidate in (field.annotation, *typing.get_args(field.annotation)):
            for arg in (candidate, *typing.get_args(candidate)):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    found = arg
        if found is None:
            return None
        model = found
    return model


def _describe(cls: type[BaseModel], err: Any) -> str:
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    key = ".".join(str(p) for p in loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        owner = _model_at(cls, loc)
        valid = sorted(owner.model_fields) if owner else []
        near = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        return f"unknown key '{key}'{hint} (valid keys here: {', '.join(valid)})"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        return f"missing required key '{key}'"
    got = err.get("input")
    shown = "" if isinstance(got, dict) or got is None else f" (got {got!r})"
    return f"key '{key}': {msg}{shown}" if loc else msg


def validate(cls: type[M], data: dict[str, Any], source: str) -> M:
    """Validate `data` as `cls`, raising `ConfigError` that names `source` and every bad key."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConfigWarning)
            model = cls.model_validate(data)
        for w in caught:
            if issubclass(w.category, ConfigWarning):
                log.warning("%s: %s", source, w.message)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return model
    except ValidationError as exc:
        lines = [f"{source}: invalid {cls.__name__}:"]
        lines += [f"  - {_describe(cls, err)}" for err in exc.errors()]
        raise ConfigError("\n".join(lines)) from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, raising `ConfigError` for a missing file, bad YAML or a non-mapping."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def load_config(cls: type[M], path: str | Path | None, overrides: dict[str, Any] | None = None,
                defaults: dict[str, Any] | None = None) -> M:
    """Load `path` (or only `defaults` when None), apply dotted `overrides`, and validate as `cls`."""
    data = dict(defaults or {})
    if path is not None:
        data.update(read_yaml(path))
    data = apply_overrides(data, overrides or {})
    source = str(path) if path is not None else "(built-in example config)"
    if overrides:
        source += " with overrides " + " ".join(f"{k}={v}" for k, v in overrides.items())
    return validate(cls, data, source)
