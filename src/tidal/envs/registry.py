"""Registry of built-in environments by id."""

from __future__ import annotations

from typing import Any

from tidal.envs.base import Environment
from tidal.envs.math import MathProblems
from tidal.envs.reverse_text import ReverseText

_REGISTRY: dict[str, type[Environment]] = {ReverseText.id: ReverseText, MathProblems.id: MathProblems}


def available() -> list[str]:
    """Ids of the registered environments."""
    return sorted(_REGISTRY)


def make_env(env_id: str, args: dict[str, Any] | None = None) -> Environment:
    """Instantiate environment `env_id` with `args`; unknown ids and bad args raise ValueError."""
    if env_id not in _REGISTRY:
        raise ValueError(f"unknown environment id '{env_id}' (available: {', '.join(available())})")
    try:
        return _REGISTRY[env_id](**(args or {}))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"environment '{env_id}': bad args {args}: {exc}") from None
