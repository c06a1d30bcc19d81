"""The field walk of TRL 1.16's inherited `TrainingArguments` fields (issue 53): every field `GRPOConfig` inherits
has its effect in tidal or is refused with the reason, so a field TRL adds is never silently ignored; the
list of fields is TRL 1.16's own (`api/trl_1_16_fields.json`, read from the wheel)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tidal.api.grpo_config import MAPPING, GRPOConfig, to_tidal
from tidal.api.training_args import EFFECTS, REMOVED, TrainingArgumentsFields

SRC = Path(__file__).resolve().parents[2] / "src" / "tidal" / "api"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "trl.md"
FIELDS = json.loads((SRC / "trl_1_16_fields.json").read_text())["fields"]
INHERITED = {f["name"]: f["default"] for f in FIELDS if f["origin"] == "TrainingArguments"}

OTHER: dict[Any, Any] = {bool: lambda v: not v, int: lambda v: v + 3, float: lambda v: v + 0.5,
                         str: lambda v: v + "_other", type(None): lambda v: "other", list: lambda v: [*v, "other"]}
"""A value other than a default, by the default's type."""


def test_every_inherited_field_is_declared_with_trls_default():
    assert len(INHERITED) == 112
    missing = sorted(set(INHERITED) - set(GRPOConfig.model_fields))
    assert not missing, f"TRL 1.16 fields tidal does not know: {missing}"
    cfg = GRPOConfig()
    wrong = {k: (getattr(cfg, k), INHERITED[k]) for k in TrainingArgumentsFields.model_fields
             if getattr(cfg, k) != INHERITED[k]}
    assert not wrong, wrong


def test_every_inherited_field_has_an_effect_or_a_reason():
    handled = set(MAPPING) | GRPOConfig.UNSUPPORTED | set(GRPOConfig.REFUSED) | EFFECTS
    refused = TrainingArgumentsFields.INHERITED_REFUSED
    assert not (handled & refused)
    assert set(INHERITED) <= handled | refused, sorted(set(INHERITED) - handled - refused)
    for key in refused:
        doc = TrainingArgumentsFields.model_fields[key].description or ""
        assert doc.startswith("Refused: ") and len(doc) > 30, (key, doc)


@pytest.mark.parametrize("key", sorted(TrainingArgumentsFields.INHERITED_REFUSED))
def test_a_refused_field_accepts_its_default_and_names_itself_otherwise(key):
    default = INHERITED[key]
    assert getattr(GRPOConfig(**{key: default}), key) == default
    other = OTHER[type(default)](default)
    with pytest.raises(ValidationError, match=rf"'{key}' \(inherited from transformers' TrainingArguments\) is "
                                              r"refused: .{20,}; leave it out or set it to its default"):
        GRPOConfig(**{key: other})


def test_fields_older_transformers_had_are_refused_with_the_reason():
    for key, why in REMOVED.items():
        with pytest.raises(ValidationError, match=f"'{key}' {why.split(' (')[0]}"):
            GRPOConfig(**{key: "x"})


def test_effect_fields_take_any_value_and_are_documented():
    cfg = GRPOConfig(use_cpu=True, do_train=True, do_eval=True, do_predict=True)
    assert cfg.use_cpu and cfg.do_train and cfg.do_eval and cfg.do_predict
    d = to_tidal(cfg, "tidal:tiny-reverse", 10, 1)  # the configs do not change: the effects are the trainer's
    assert d.orch == to_tidal(GRPOConfig(), "tidal:tiny-reverse", 10, 1).orch
    text = DOCS.read_text()
    missing = [k for k in sorted(INHERITED) if f"`{k}`" not in text]
    assert not missing, f"docs/trl.md does not mention {missing}"
