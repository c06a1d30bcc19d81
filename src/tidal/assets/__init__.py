"""Bundled assets: the tiny reverse-text model. `tidal:NAME` in a config's model key names one of them."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent
PREFIX = "tidal:"


def resolve_model(name: str) -> str:
    """`tidal:tiny-reverse` -> absolute path of the bundled model; anything else unchanged."""
    if not name.startswith(PREFIX):
        return name
    path = ASSETS / name[len(PREFIX):]
    if not (path / "config.json").is_file():
        known = sorted(p.name for p in ASSETS.iterdir() if (p / "config.json").is_file())
        raise FileNotFoundError(f"no bundled model '{name}' (bundled: {', '.join(PREFIX + k for k in known)})")
    return str(path)
