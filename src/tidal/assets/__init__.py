"""Bundled assets and model names: `tidal:NAME` names a bundled model (the tiny reverse-text model), a path an
existing local model directory, and `org/name[@revision]` a Hugging Face Hub model (`tidal.hub`)."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent
PREFIX = "tidal:"


def resolve_model(name: str) -> str:
    """The directory a config's `model` names: `tidal:tiny-reverse` -> the bundled model; an existing local
    directory -> unchanged (it wins over a Hub id of the same spelling); `org/name[@revision]` -> its snapshot
    in the Hugging Face cache, downloaded if needed and allowed (`tidal.hub.resolve_hub_model`, which raises
    `HubModelError`, a FileNotFoundError); anything else unchanged (the caller finds no model directory there,
    `tidal.models.files`)."""
    if name.startswith(PREFIX):
        return bundled(name)
    if Path(name).expanduser().is_dir():
        return name
    from tidal.hub import resolve_hub_model

    return resolve_hub_model(name) or name


def bundled(name: str) -> str:
    """`tidal:NAME` -> absolute path of the bundled model NAME (FileNotFoundError listing them if none). What the
    directory holds is the caller's question, as for any local directory (`tidal.models.files.is_model_dir`)."""
    known = sorted(p.name for p in ASSETS.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    if name[len(PREFIX):] not in known:
        raise FileNotFoundError(f"no bundled model '{name}' (bundled: {', '.join(PREFIX + k for k in known)})")
    return str(ASSETS / name[len(PREFIX):])
