"""Registry of environments by id: the built-ins, `register`ed classes, `package.module:Name` paths (an
Environment subclass, or a factory / object giving an Environment or a verifiers environment), and
`verifiers:NAME` (an installed verifiers environment; with verifiers 0.4 a taskset package: `tidal.envs.verifiers`).
A factory may also give a verifiers 0.4 `Taskset`."""

from __future__ import annotations

from typing import Any

from tidal.envs.addition import Addition
from tidal.envs.agent import make_agent
from tidal.envs.base import Environment
from tidal.envs.calculator import Calculator
from tidal.envs.dataset import DatasetEnv
from tidal.envs.longtail import ReverseTextLongTail
from tidal.envs.math import MathProblems
from tidal.envs.openenv import OpenEnv
from tidal.envs.reverse_text import ReverseText
from tidal.envs.shapes import VisualShapes

_REGISTRY: dict[str, type[Environment]] = {ReverseText.id: ReverseText, MathProblems.id: MathProblems,
                                           Calculator.id: Calculator, DatasetEnv.id: DatasetEnv,
                                           OpenEnv.id: OpenEnv,  # openenv-core imported on first use
                                           ReverseTextLongTail.id: ReverseTextLongTail,
                                           VisualShapes.id: VisualShapes, Addition.id: Addition}


def available() -> list[str]:
    """Ids of the registered environments (and `agent`: a user's agent program, `tidal.envs.agent`)."""
    return sorted([*_REGISTRY, "agent"])


def register(cls: type[Environment]) -> type[Environment]:
    """Class decorator adding an environment to the registry under its `id`."""
    if not cls.id:
        raise ValueError(f"{cls.__name__} has no `id`")
    _REGISTRY[cls.id] = cls
    return cls


def _import(env_id: str) -> Any:
    import importlib

    module, _, name = env_id.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"environment '{env_id}': cannot import it ({exc})") from None


def make_env(env_id: str, args: dict[str, Any] | None = None) -> Environment:
    """Instantiate environment `env_id` with `args`; unknown ids and bad args raise ValueError."""
    from tidal.envs import verifiers

    if env_id.startswith("verifiers:"):
        return verifiers.load(env_id.removeprefix("verifiers:"), args)
    if env_id == "agent":  # the user's agent program (tidal.envs.agent); its task environment built here
        return make_agent(args or {}, make_env)
    target: Any = _REGISTRY.get(env_id)
    if target is None and ":" not in env_id:
        raise ValueError(f"unknown environment id '{env_id}' (available: {', '.join(available())}, "
                         f"'package.module:Name' or 'verifiers:NAME')")
    if target is None:
        target = _import(env_id)
    if verifiers.is_verifiers(target):  # a module-level object
        if args:
            raise ValueError(f"environment '{env_id}' is an environment object; it takes no args (got {args})")
        return verifiers.adapt(target, env_id)
    if not callable(target) or isinstance(target, Environment):
        raise ValueError(f"environment '{env_id}' is neither an Environment subclass nor a factory returning one")
    try:
        made = target(**(args or {}))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"environment '{env_id}': bad args {args}: {exc}") from None
    if isinstance(made, Environment):
        return made
    if verifiers.is_verifiers(made):
        return verifiers.adapt(made, env_id)
    raise ValueError(f"environment '{env_id}' gave a {type(made).__name__}, not a tidal Environment or a verifiers "
                     "environment")
