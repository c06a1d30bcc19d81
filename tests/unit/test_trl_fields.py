"""TRL 1.16 `GRPOConfig`'s own fields (origin `GRPOConfig` in trl_1_16_fields.json), walked: each is a key of
tidal's `GRPOConfig`, mapped (with an effect) or refused at any value but TRL's default, and its default is TRL
1.16's unless `DIFFERENT_DEFAULTS` says why; a field TRL adds fails here until it is handled. The list itself
is checked against TRL's wheel where TRL 1.16 is importable (`.venv/bench-trl`, as the parity tests)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tests.unit.trl_fields import fields_of, trl_fields
from tidal.api.grpo_config import MAPPING, GRPOConfig

DIFFERENT_DEFAULTS = {
    "vllm_server_host": "tidal's server binds to 127.0.0.1 (TRL 0.0.0.0): no open port unless asked",
    "vllm_gpu_memory_utilization": "None: vLLM is sized by the run's need, the trainer gets the rest (docs/gpu.md)",
}
"""TRL-own fields whose tidal default differs from TRL 1.16's, and why."""


@pytest.mark.parametrize("name", sorted(fields_of("GRPOConfig")))
def test_each_trl_grpo_config_field_is_handled(name):
    assert name in GRPOConfig.model_fields, f"TRL 1.16 GRPOConfig.{name} is not a tidal GRPOConfig key"
    handled = name in MAPPING or name in GRPOConfig.UNSUPPORTED or name in GRPOConfig.REFUSED
    assert handled, f"GRPOConfig.{name} is neither mapped (MAPPING) nor refused (UNSUPPORTED / REFUSED)"
    ours = GRPOConfig.model_fields[name].get_default(call_default_factory=True)
    theirs = fields_of("GRPOConfig")[name]
    if name in DIFFERENT_DEFAULTS:
        assert ours != theirs
    else:
        assert ours == theirs or (isinstance(theirs, float) and math.isnan(theirs)), (name, ours, theirs)
        GRPOConfig(**{name: theirs})  # TRL's default is accepted as written


def test_the_field_list_is_trl_1_16s():
    from tests.unit.test_trl_parity import import_trl

    import_trl()  # skips without TRL 1.16
    import trl

    ours = [(f["name"], f["origin"]) for f in trl_fields()]
    own = {f.name for f in dataclasses.fields(trl.GRPOConfig)} - {
        f.name for f in dataclasses.fields(trl.GRPOConfig.__mro__[1])}
    theirs = [(f.name, "GRPOConfig" if f.name in own else "TrainingArguments")
              for f in dataclasses.fields(trl.GRPOConfig) if f.init]
    assert sorted(ours) == sorted(theirs)
    for f in dataclasses.fields(trl.GRPOConfig):
        if f.init and f.name in own and f.default is not dataclasses.MISSING:
            assert fields_of("GRPOConfig")[f.name] == f.default, f.name
