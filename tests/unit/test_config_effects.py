"""No config key is parsed without an effect (README: "no key accepted and ignored").

Walks every pydantic config model (TrainConfig, InferConfig, OrchConfig and all their sections, recursively) and
requires of every field one of:
(a) it is read somewhere in `src/tidal` outside `src/tidal/config/` (an attribute access `.name`, or the string
    `"name"` / `'name'`, e.g. a `getattr` or a request payload key, in the source text);
(b) it is listed in its model's `UNSUPPORTED` or `REFUSED` (`tidal.config.base`: any value but the default is
    an error), so it cannot be set without an effect; a section all of whose keys are so counts too;
(c) it is in `ALLOWED` below, with the reason it has an effect although (a) does not see it.
A new field that nothing reads fails here until it is wired, refused, or explained. The search is by name, so
it is a floor, not a proof: a name read for another key of the same spelling also passes (a).
"""

from __future__ import annotations

import re
import typing
from functools import cache
from pathlib import Path

import pytest
from pydantic import BaseModel

from tidal.config import InferConfig, OrchConfig, TrainConfig

SRC = Path(__file__).resolve().parents[2] / "src" / "tidal"
CONFIG_DIR = SRC / "config"

ALLOWED: dict[str, str] = {
}
"""`Model.field` -> why it has an effect that the source search does not see (one line each)."""


def submodels(annotation: typing.Any) -> list[type[BaseModel]]:
    """The config models inside a field's annotation (`X`, `X | None`, `list[X]`, `list[A | B]`, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in submodels(arg)]


def all_models() -> list[type[BaseModel]]:
    seen: list[type[BaseModel]] = []
    todo: list[type[BaseModel]] = [TrainConfig, InferConfig, OrchConfig]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.append(model)
        for field in model.model_fields.values():
            todo += submodels(field.annotation)
    return sorted(seen, key=lambda m: m.__name__)


FIELDS = [(m, name) for m in all_models() for name in m.model_fields]


@cache
def source_outside_config() -> str:
    files = [p for p in SRC.rglob("*.py") if CONFIG_DIR not in p.parents]
    assert len(files) > 30, f"expected tidal's source under {SRC}"
    return "\n".join(p.read_text() for p in files)


def refused(model: type[BaseModel], name: str) -> bool:
    """(b): any value but the default is an error (for a section: for each of its keys)."""
    if name in model.UNSUPPORTED or name in model.REFUSED:  # type: ignore[attr-defined]
        return True
    subs = submodels(model.model_fields[name].annotation)
    return bool(subs) and all(refused(sub, key) for sub in subs for key in sub.model_fields)


def read_in_source(name: str) -> bool:
    pattern = rf"\.{re.escape(name)}\b|[\"']{re.escape(name)}[\"']"
    return re.search(pattern, source_outside_config()) is not None


def test_the_walk_reaches_every_section():
    names = {m.__name__ for m, _ in FIELDS}
    for expected in ("LossConfig", "NoiseSchedulerConfig", "SftSection", "TrainWeightBroadcast", "EnvSection",
                     "EvalSection", "GibberishFilter", "RepetitionFilter", "TempSchedulerSection", "ElasticSection",
                     "TeacherSection", "ReportSection", "RewardFuncSection"):
        assert expected in names
    assert len(FIELDS) > 150


@pytest.mark.parametrize(("model", "name"), FIELDS, ids=[f"{m.__name__}.{n}" for m, n in FIELDS])
def test_every_key_has_an_effect(model, name):
    if refused(model, name):
        return
    key = f"{model.__name__}.{name}"
    if key in ALLOWED:
        return
    assert read_in_source(name), (
        f"{key} is parsed but nothing outside src/tidal/config reads `.{name}` or '{name}': wire it, add it to "
        f"{model.__name__}.UNSUPPORTED / REFUSED, or explain in ALLOWED (tests/unit/test_config_effects.py)")


def test_allow_list_entries_are_real_fields_with_reasons():
    fields = {f"{m.__name__}.{n}" for m, n in FIELDS}
    for key, why in ALLOWED.items():
        assert key in fields, f"ALLOWED names {key}, which is no config field"
        assert len(why) > 20, f"ALLOWED[{key!r}] needs a reason"


def test_the_search_catches_an_unread_name():
    assert read_in_source("lora_rank") and read_in_source("chat_template_kwargs")
    assert not read_in_source("a_key_nothing_reads_" + "x" * 8)


def test_refusal_counts_only_for_refused_keys_and_fully_refused_sections():
    from tidal.config.train import NoiseSchedulerConfig

    assert refused(TrainConfig, "qlora_fp4") and refused(InferConfig, "reasoning_parser")
    assert not refused(NoiseSchedulerConfig, "enabled") and not refused(TrainConfig, "noise_scheduler")
    assert not refused(TrainConfig, "loss") and not refused(TrainConfig, "learning_rate")
    assert not refused(TrainConfig, "qlora_bnb") and not refused(TrainConfig, "qlora_fp8")
