"""The trainer process's body once its config is loaded: `tidal grpo-train` (`tidal.cli.cmd_train`) and a trainer
forked from the warm pool's kept base (`tidal.colocate.warm_trainer`) both run `run_trainer`.

It sets up this process's rank (torch.distributed when `tidal grpo-train` started several), trains
(`tidal.trainer.grpo.run`) and maps each way a run ends to the process's exit code: 0 done; 1 a failure the
trainer names in one line (a mismatch past the guard, a checkpoint or batch it cannot read, a timeout, out of
memory, a slim reload that cannot be made); `tidal.procs.EXPORT_FAILED` trained to the end with a final export
missing. A bad rank or device setting is a `ConfigError` (exit 2, from the caller).
"""

from __future__ import annotations

import logging
from pathlib import Path

from tidal.config.load import ConfigError
from tidal.config.train import TrainConfig
from tidal.paths import rollouts_dir


def run_trainer(cfg: TrainConfig, run_dir: Path) -> int:
    """Train `cfg` in `run_dir` as this process's rank; returns the exit code (module docs)."""
    from tidal.checkpoint import CheckpointError
    from tidal.procs import EXPORT_FAILED
    from tidal.trainer import distributed, grpo
    from tidal.trainer.memory import TrainerOutOfMemory, exits_on_oom
    from tidal.trainer.publish.broadcast import SlimReloadError
    from tidal.trainer.publish.export import GGUFExportError
    from tidal.trainer.step.health import MismatchError
    from tidal.transport.batch import BatchFormatError

    rollouts_dir(run_dir).mkdir(parents=True, exist_ok=True)
    try:
        ranks, device = distributed.init_ranks(cfg.gpus, cfg.device, cfg.batch_timeout_s + 600)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(str(exc)) from None
    if ranks.sharded:
        cfg = cfg.model_copy(update={"device": device,
                                     "cpu_affinity": distributed.rank_cores(cfg.cpu_affinity, ranks)})
    try:
        with exits_on_oom(cfg):
            grpo.run(cfg, run_dir, ranks)
    except (MismatchError, CheckpointError, BatchFormatError, TimeoutError, TrainerOutOfMemory,
            SlimReloadError) as exc:
        logging.getLogger("tidal.trainer").error("stopping: %s", exc)
        return 1
    except GGUFExportError as exc:  # trained to the end; the file asked for is missing (exit code says so)
        logging.getLogger("tidal.trainer").error("%s", exc)
        distributed.close(ranks)
        return EXPORT_FAILED
    distributed.close(ranks)
    return 0
