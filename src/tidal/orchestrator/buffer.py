"""The example buffer: which examples are drawn, which sampled groups go into a batch (`buffer.*`).

- **Dedupe** (`hash_keys`): an example is identified by a hash of those fields (`task`, `prompt`, `answer`,
  or `info` columns); one batch never holds the same example twice, and examples in the easy or hard pool are
  not drawn again (a finite dataset that runs out of fresh examples falls back to repeats after 100 draws).
- **Difficulty pools** (`easy_threshold`, `hard_threshold`): after scoring, an example whose group mean reward
  is >= `easy_threshold` moves to the easy pool, <= `hard_threshold` to the hard pool. On a resume,
  `easy_fraction` / `hard_fraction` of each pool is promoted back to normal (drawn at random).
- **Group filters**: `online_difficulty_filtering` drops groups whose mean reward is 0 or 1;
  `dynamic_sampling` (DAPO) drops groups whose rewards all agree (zero std). Dropped groups are replaced by
  sampling more (`oversampling_factor` over-asks from the start), for at most `max_sampling_rounds` rounds;
  if the batch is still short it is filled with dropped groups, so every batch has `batch_size` rollouts.
Pools are part of the orchestrator's checkpoint (`skip_buffer` leaves them empty).
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import numpy as np

from tidal.config.orch import BufferSection
from tidal.envs.base import Example

MAX_FRESH_DRAWS = 100


def example_key(example: Example, keys: list[str]) -> str:
    fields = {"task": example.task, "prompt": example.prompt, "answer": example.answer}
    picked = {k: fields[k] if k in fields else example.info.get(k) for k in keys}
    return hashlib.sha1(json.dumps(picked, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Buffer:
    """Example admission, group filtering and difficulty pools of one orchestrator."""

    def __init__(self, cfg: BufferSection, dynamic_sampling: bool = False) -> None:
        """orch `buffer` and `dynamic_sampling`."""
        self.cfg = cfg
        self.dynamic = dynamic_sampling
        self.easy: set[str] = set()
        self.hard: set[str] = set()
        self.step_keys: set[str] = set()
        self.counts: dict[str, float] = {}

    @property
    def filtering(self) -> bool:
        return self.cfg.online_difficulty_filtering or self.dynamic

    def new_step(self) -> None:
        self.step_keys = set()
        self.counts = dict.fromkeys(("buffer/duplicates_skipped", "buffer/dropped_groups", "buffer/rounds",
                                     "buffer/filled_with_dropped"), 0.0)

    def draw(self, source: Any, rng: random.Random) -> Example:
        """An example from `source.sample(rng)` that is neither in this batch nor in a pool (if possible)."""
        for _ in range(MAX_FRESH_DRAWS):
            ex = source.sample(rng)
            key = example_key(ex, self.cfg.hash_keys)
            if key not in self.step_keys and key not in self.easy and key not in self.hard:
                self.step_keys.add(key)
                return ex
            self.counts["buffer/duplicates_skipped"] += 1
        return ex

    def judge(self, example: Example, rewards: np.ndarray) -> bool:
        """Update the pools with a scored group; True when the group may go into the batch."""
        mean = float(np.mean(rewards)) if len(rewards) else 0.0
        key = example_key(example, self.cfg.hash_keys)
        if self.cfg.easy_threshold is not None and mean >= self.cfg.easy_threshold:
            self.easy.add(key)
        elif self.cfg.hard_threshold is not None and mean <= self.cfg.hard_threshold:
            self.hard.add(key)
        if self.cfg.online_difficulty_filtering and mean in (0.0, 1.0):
            return False
        return not (self.dynamic and len(rewards) > 1 and float(np.max(rewards) - np.min(rewards)) == 0.0)

    def metrics(self) -> dict[str, float]:
        return {**self.counts, "buffer/easy": float(len(self.easy)), "buffer/hard": float(len(self.hard))}

    def state(self) -> dict[str, Any]:
        return {"easy": sorted(self.easy), "hard": sorted(self.hard)}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore the pools, promoting `easy_fraction` / `hard_fraction` of each back to normal (a fixed
        choice: the sampler's RNG is not touched, so the resumed run draws what the original would have)."""
        for name, fraction in (("easy", self.cfg.easy_fraction), ("hard", self.cfg.hard_fraction)):
            pool = sorted(state.get(name, []))
            promote = set(random.Random(0).sample(pool, int(round(fraction * len(pool))))) if pool else set()
            setattr(self, name, set(pool) - promote)
