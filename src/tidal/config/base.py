"""Shared pieces of the config models: strict base class and the "not supported yet" guard.

Every model forbids unknown keys. Keys that the seed's tables define but tidal does not implement yet are
declared as fields too (so the error is precise), and `UNSUPPORTED` lists them: setting one to anything but
its documented default fails with "not supported yet" instead of being silently ignored. `REFUSED` maps keys
whose other values could have no effect in tidal to the reason, which the error gives.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator


class ConfigWarning(UserWarning):
    """A setting that is valid but probably not what the user wants; logged with the file's name."""


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(),
                              use_attribute_docstrings=True)

    UNSUPPORTED: ClassVar[frozenset[str]] = frozenset()
    REFUSED: ClassVar[dict[str, str]] = {}
    """key -> why a value other than the default would have no effect (the error says it)."""

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not (cls.UNSUPPORTED or cls.REFUSED):
            return data
        for key in sorted((cls.UNSUPPORTED | set(cls.REFUSED)) & set(data)):
            default = cls.model_fields[key].get_default(call_default_factory=True)
            if data[key] != default:
                why = cls.REFUSED.get(key, "is not supported yet by tidal")
                raise ValueError(f"key '{key}' {why} (leave it out or set it to its default {default!r})")
        return data
