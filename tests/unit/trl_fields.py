"""TRL 1.16 `GRPOConfig`'s init fields, from `src/tidal/api/trl_1_16_fields.json` (generated from the wheel;
`tests/unit/test_trl_fields.py` checks it against an importable TRL 1.16). Shared by the field walks: issue 51's
(origin `GRPOConfig`: TRL's own fields) and issue 53's (origin `TrainingArguments`: inherited from transformers)."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any


@cache
def trl_fields() -> list[dict[str, Any]]:
    """[{name, origin, default}] of TRL 1.16 GRPOConfig's init fields, from the copy installed with tidal."""
    text = resources.files("tidal.api").joinpath("trl_1_16_fields.json").read_text()
    return list(json.loads(text)["fields"])


def fields_of(origin: str) -> dict[str, Any]:
    """name -> TRL's default of the fields of one origin (`GRPOConfig` or `TrainingArguments`)."""
    return {f["name"]: f["default"] for f in trl_fields() if f["origin"] == origin}
