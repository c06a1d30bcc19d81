"""Loaded by every Python process whose PYTHONPATH starts with this directory (tests/unit/test_trainer_oom.py,
tests/e2e/test_trainer_oom_run.py): in a `tidal grpo-train` process with TIDAL_TEST_OOM_AT=NAME[,NAME] set, each
named function of `tidal.trainer.grpo` raises CUDA's out-of-memory error when called, as the CUDA caching allocator
does. The one failure a CPU cannot cause for real; everything around it (the trainer's handling, the CLI's exit,
the launcher's shutdown) runs as it would on a GPU. Any other process is left alone."""

import os
import sys

_names = os.environ.get("TIDAL_TEST_OOM_AT")
if _names and "grpo-train" in sys.orig_argv:
    import torch

    import tidal.trainer.grpo as _grpo

    def _out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total "
                                          "capacity of 79.18 GiB of which 1.20 GiB is free (forced by the test)")

    for _name in _names.split(","):
        assert hasattr(_grpo, _name), f"tidal.trainer.grpo has no {_name}"
        setattr(_grpo, _name, _out_of_memory)
