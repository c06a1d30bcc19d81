"""The files tidal ships: `ASSETS`, the folder of the bundled models (the tiny reverse-text model,
`tidal:tiny-reverse`), and `PREFIX`, how a config names one (`tidal:NAME`). How a model name becomes a directory:
`tidal.models.sources`."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent
PREFIX = "tidal:"
