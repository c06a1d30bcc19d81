"""Typed, torch-free configuration for the three components.

`TrainConfig`, `InferConfig` and `OrchConfig` mirror the key tables of Surogate's GRPO guide (seed 000);
`load_config` reads a YAML file plus dotted CLI overrides and turns every mistake into a `ConfigError`
that names the file, the key and what would be valid.
"""

from tidal.config.infer import InferConfig
from tidal.config.load import ConfigError, load_config
from tidal.config.orch import OrchConfig
from tidal.config.train import TrainConfig

__all__ = ["ConfigError", "InferConfig", "OrchConfig", "TrainConfig", "load_config"]
