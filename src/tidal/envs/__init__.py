"""Environments: where training examples come from and how completions are scored."""

from tidal.envs.base import Environment, Example
from tidal.envs.registry import available, make_env

__all__ = ["Environment", "Example", "available", "make_env"]
