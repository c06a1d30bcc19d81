"""The Python front for scripts written for TRL: `from tidal import GRPOConfig, GRPOTrainer` (docs/trl.md).

- `grpo_config`: `GRPOConfig`, TRL 1.16's arguments as one typed model, and `to_tidal`, its mapping onto tidal's
  three configs; `loss_keys` (TRL's loss and algorithm keys) and `training_args` (the `TrainingArguments` fields,
  `trl_1_16_fields.json`) are its parts.
- `trainer`: `GRPOTrainer`, which runs the `tidal grpo` pipeline with the orchestrator in the caller's process;
  `args` (TRL's other constructor arguments: used, or refused with the reason) and `callbacks` (transformers
  TrainerCallbacks fed from the run's metrics) are its parts.

The tinker front is its twin (`tidal.tinker`). Torch-free to import: the trainer's process starts torch.
"""

from tidal.api.grpo_config import GRPOConfig
from tidal.api.trainer import GRPOTrainer, RefusedConfig, TrainOutput

__all__ = ["GRPOConfig", "GRPOTrainer", "RefusedConfig", "TrainOutput"]
