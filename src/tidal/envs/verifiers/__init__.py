"""The `verifiers` package's environments as tidal environments: one entry point for both of its APIs.

- `classic` — verifiers 0.1.9 to 0.3.x: `vf.SingleTurnEnv` / `MultiTurnEnv` / `ToolEnv` objects with a `Rubric`
  (`VerifiersEnv`);
- `v1` — verifiers 0.4: `verifiers.v1` tasksets, scored on traces (`VerifiersV1Env`; its tool sessions in
  `v1_tools`, the traces and the refusal error in `v1_trace`);
- `common` — what both share (running verifiers' coroutines, message contents).

`load("NAME", args)` is `env: [{id: "verifiers:NAME"}]`: the classic `verifiers.load_environment` when the installed
verifiers has it, else the installed 0.4 taskset package NAME. `adapt(obj, env_id)` wraps an environment object or
taskset given by an import path (`package.module:factory`), and `is_verifiers(obj)` says whether it is one. The
imports go one way: this loader -> `classic` | `v1` -> `v1_tools` -> `v1_trace` -> `common`.
"""

from __future__ import annotations

from typing import Any

from tidal.envs.base import Environment
from tidal.envs.verifiers.classic import VerifiersEnv, is_verifiers_env, load_classic
from tidal.envs.verifiers.v1 import VerifiersV1Env, available, is_v1_taskset
from tidal.envs.verifiers.v1 import load as load_v1


def load(name: str, args: dict[str, Any] | None = None) -> Environment:
    """`verifiers:NAME`: with classic verifiers (< 0.4), `verifiers.load_environment(name, **args)` (an installed
    environment package); with verifiers 0.4, the installed taskset package `name`; adapted."""
    try:
        import verifiers as vf
    except ImportError:
        raise ValueError(f"environment 'verifiers:{name}' needs the verifiers package (pip install verifiers: "
                         "0.4, or the classic API 'verifiers<0.4')") from None
    if getattr(vf, "load_environment", None) is not None:
        return load_classic(vf, name, args)
    if available():
        return load_v1(name, args)
    raise ValueError(f"environment 'verifiers:{name}': verifiers {getattr(vf, '__version__', '?')} has neither "
                     "the classic load_environment (< 0.4) nor verifiers.v1 (0.4)")


def is_verifiers(obj: Any) -> bool:
    """Whether `obj` is a verifiers environment object (classic) or taskset (0.4)."""
    return is_verifiers_env(obj) or is_v1_taskset(obj)


def adapt(obj: Any, env_id: str) -> Environment:
    """A verifiers environment object or taskset (`is_verifiers`) as the tidal environment `env_id`."""
    if is_v1_taskset(obj):
        return VerifiersV1Env(obj, env_id)
    if is_verifiers_env(obj):
        return VerifiersEnv(obj, env_id)
    raise ValueError(f"environment '{env_id}': a {type(obj).__name__} is not a verifiers environment or taskset")


__all__ = ["VerifiersEnv", "VerifiersV1Env", "adapt", "is_verifiers", "load"]
