"""Registry of environments by id: the built-ins, `register`ed classes, and `package.module:Class` paths."""

from __future__ import annotations

from typing import Any

from tidal.envs.base import Environment
from tidal.envs.calculator import Calculator
from tidal.envs.math import MathProblems
from tidal.envs.reverse_text import ReverseText

_REGISTRY: dict[str, type[Environment]] = {ReverseText.id: ReverseText, MathProblems.id: MathProblems,
                                           Calculator.id: Calculator}


def available() -> list[str]:
    """Ids of the registered environments."""
    return sorted(_REGISTRY)


def register(cls: type[Environment]) -> type[Environment]:
    """Class decorator adding an environment to the registry under its `id`."""
    if not cls.id:
        raise ValueError(f"{cls.__name__} has no `id`")
    _REGISTRY[cls.id] = cls
    return cls


def resolve(env_id: str) -> type[Environment]:
    """A registered id, or `package.module:ClassName` (imported; the class must subclass Environment)."""
    if env_id in _REGISTRY:
        return _REGISTRY[env_id]
    if ":" in env_id:
        import importlib

        module, _, name = env_id.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"environment '{env_id}': cannot import it ({exc})") from None
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise ValueError(f"environment '{env_id}' is not a tidal.envs.Environment subclass")
        return cls
    raise ValueError(f"unknown environment id '{env_id}' (available: {', '.join(available())}, or "
                     f"'package.module:ClassName')")


def make_env(env_id: str, args: dict[str, Any] | None = None) -> Environment:
    """Instantiate environment `env_id` with `args`; unknown ids and bad args raise ValueError."""
    cls = resolve(env_id)
    try:
        return cls(**(args or {}))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"environment '{env_id}': bad args {args}: {exc}") from None
