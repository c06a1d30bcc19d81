"""A small OpenEnv environment written with openenv-core's server helpers (no containers): reverse a random text.

`reset(seed)` draws the text from the seed (deterministic, as tidal needs: a group shares one prompt); each `step`
takes the model's turn (`ReverseAction.message`), rewards the similarity of the `<reversed_text>` answer to the
reversed text (the bundled model's format), and ends the episode when it is exact or after `MAX_STEPS` steps; until
then the next observation asks again. Hooks for failure tests: a message containing `BOOM` makes `step` raise (a
server-side error), `SLOW` makes it sleep `SLOW_S` seconds (an action that hangs it: `/health` still answers, the step
runs in openenv-core's thread pool), `DIE` makes the server process exit at once (a server the action kills: only
under a server of its own process, never one served in the test's), and `reset(fail=True)` raises; with
`fail_every=k`, the episodes whose seed is a multiple of k fail at their first step.

Served by `uvicorn tests.e2e.openenv_reverse:app` (8 concurrent sessions), or by tidal from `args.app`.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from tidal.envs.reverse_text import ReverseText, extract_answer, similarity

MAX_STEPS = 3
SLOW_S = 3.0
SESSIONS = 8


class ReverseAction(Action):
    message: str = Field(..., description="the model's turn")


class ReverseObservation(Observation):
    prompt: str = Field("", description="what the model is asked")


class ReverseEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.text, self.fail = "", False
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, fail: bool = False,
              fail_every: int = 0, **kwargs: Any) -> ReverseObservation:
        if fail:
            raise RuntimeError("reset asked to fail")
        self.text = ReverseText(4, 12).random_text(random.Random(seed))
        self.fail = bool(fail_every) and seed is not None and seed % fail_every == 0
        self._state = State(episode_id=episode_id, step_count=0)
        return ReverseObservation(prompt=self.text, done=False, reward=None)

    def step(self, action: ReverseAction, timeout_s: float | None = None, **kwargs: Any) -> ReverseObservation:  # type: ignore[override]
        if "BOOM" in action.message or self.fail:
            raise RuntimeError("the environment broke")
        if "DIE" in action.message:
            os._exit(3)
        if "SLOW" in action.message:
            time.sleep(SLOW_S)
        self._state.step_count += 1
        score = similarity(extract_answer(action.message), self.text[::-1])
        done = score == 1.0 or self._state.step_count >= MAX_STEPS
        again = f"Not quite ({score:.2f}). Reverse it again: {self.text}"
        return ReverseObservation(prompt="" if done else again, done=done, reward=score)

    @property
    def state(self) -> State:
        return self._state


app = create_app(ReverseEnvironment, ReverseAction, ReverseObservation, env_name="reverse",
                 max_concurrent_envs=SESSIONS)
