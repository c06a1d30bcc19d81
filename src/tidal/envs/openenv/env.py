"""`OpenEnv`: an OpenEnv server's environment as a tidal environment (examples, multi-turn episodes, rewards).

- Examples: `sample(rng)` draws a seed from the run's RNG and asks the server for that seed's first observation
  (`POST /reset`, stateless); the prompt is `system_prompt` (if any) and the observation as the user message. The
  seed travels in `Example.info["openenv_seed"]`, so runs and resumes draw the same episodes.
- Episodes: through tidal's tool loop (`tooling` is an `OpenEnvTooling`), one WebSocket session per rollout
  (`tidal.envs.openenv.session`): reset with the example's seed, the model's turns as actions, observations as
  user messages, until `done` or `max_turns`.
- Rewards: each rollout's `Episode` (its step rewards: `sum` or `last`); an episode the server failed was not judged
  (`Completion.env_error`: no loss, out of its group's baseline; many of them make an outage the orchestrator waits
  out: `tidal.orchestrator.outage`, which asks `/health` through `unavailable`).
- The server is started (`app`) or reached (`base_url`) on the first `sample`, not when the environment is built, so
  `tidal grpo`'s up-front checks build it without starting a server; a server that does not come up then stops the
  run with the reason (a setup error); once it is up, its failures are counted, never raised.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
from typing import Any

import httpx

from tidal.config.environments import check_openenv_args
from tidal.envs.base import Environment, Example
from tidal.envs.openenv.server import ServerError, ServerHandle
from tidal.envs.openenv.session import Episode, InvalidAction, ObservationError, OpenEnvTooling, render_observation
from tidal.envs.tools import load_object

log = logging.getLogger("tidal.orch")

EXTRA = "pip install 'tidal[openenv]' (openenv-core 0.3)"
MAX_SEEN = 10_000


def require_openenv_core() -> str:
    """The installed openenv-core's version; ValueError naming the extra when it (or a dependency of its client and
    server helpers) cannot be imported."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        import openenv.core  # noqa: F401 - what the sessions use; fails early here instead of in every episode

        return version("openenv-core")
    except (ImportError, PackageNotFoundError) as exc:
        raise ValueError(f"the OpenEnv environment needs the openenv-core package ({exc}): {EXTRA}") from None


class OpenEnv(Environment):
    """An environment served by an OpenEnv server; `args` are orch `OpenEnvArgs` (docs/orchestrator.md)."""

    id = "openenv"

    def __init__(self, **args: Any) -> None:
        self.args = check_openenv_args(args)
        self.openenv_version = require_openenv_core()
        self.max_turns = self.args.max_turns
        self.parser = load_object(self.args.action_parser, "OpenEnv args.action_parser") \
            if self.args.action_parser else None
        if self.parser is not None and not callable(self.parser):
            raise ValueError(f"OpenEnv args.action_parser '{self.args.action_parser}' is not a function")
        self.server = ServerHandle(self.args.base_url, self.args.app, self.args.timeout_s)
        self.tooling = OpenEnvTooling(self)
        self.failures: dict[str, int] = {}
        """Episodes per kind of trouble ('server failure', 'invalid action'), for the whole run."""
        self._logged: set[str] = set()
        self._seen: dict[str, int] = {}
        self._start_lock = threading.Lock()

    def start(self) -> None:
        """Start or reach the server (once); ValueError when it does not come up."""
        with self._start_lock:
            self.server.start(self.args.startup_timeout_s)

    def close(self) -> None:
        """Stop a server started from `app` (it is also stopped when the process exits)."""
        self.server.stop()

    def sample(self, rng: random.Random) -> Example:
        """A seed and its first observation as the prompt; a server failure gives a placeholder prompt whose
        episodes fail (scored as failed rewards)."""
        self.start()
        seed = rng.randrange(2**31)
        error = None
        try:
            payload = self.server.reset(seed, self.args.reset_args)
            text = render_observation(payload["observation"], self.args.observation_template)
            self._check_fresh(text, seed)
        except (ServerError, ObservationError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            text = "(the environment server failed to reset)"
            self.note("server failure", error)
        prompt = [{"role": "system", "content": self.args.system_prompt}] if self.args.system_prompt else []
        prompt.append({"role": "user", "content": text})
        return Example(prompt=prompt, info={"openenv_seed": seed, "openenv_error": error})

    def _check_fresh(self, text: str, seed: int) -> None:
        """Warn (once) when two seeds give the same first observation: the buffer would redraw them as repeats."""
        key = hashlib.sha1(text.encode()).hexdigest()
        first = self._seen.setdefault(key, seed) if len(self._seen) < MAX_SEEN else self._seen.get(key, seed)
        if first != seed and "same first observation" not in self._logged:
            self._logged.add("same first observation")
            log.warning("OpenEnv environment: seeds %d and %d gave the same first observation (%r); the buffer tells "
                        "examples apart by their prompt (buffer.hash_keys, default [task, prompt]) and redraws "
                        "repeats, so set buffer.hash_keys: [task, openenv_seed] when the first observation does "
                        "not show the episode", first, seed, text[:80])

    def action(self, text: str) -> dict[str, Any]:
        """The action of a model turn's text: `{action_field: text}`, or `action_parser(text)` (a dict or a pydantic
        model); InvalidAction when the parser refuses it."""
        if self.parser is None:
            return {self.args.action_field: text}
        try:
            action = self.parser(text)
        except (ValueError, TypeError, KeyError) as exc:
            raise InvalidAction(f"action_parser refused the turn: {type(exc).__name__}: {exc}") from None
        if hasattr(action, "model_dump"):
            action = action.model_dump()
        if not isinstance(action, dict):
            raise InvalidAction(f"action_parser returned a {type(action).__name__}, not a dict")
        return action

    def note(self, kind: str, detail: str) -> None:
        """Count an episode's trouble; the first of each kind is logged with its detail."""
        self.failures[kind] = self.failures.get(kind, 0) + 1
        if kind in self._logged:
            return
        self._logged.add(kind)
        if kind == "server failure":
            log.warning("OpenEnv environment at %s: an episode failed (%s); episodes the server failed are not "
                        "judged: no loss, out of their group's baseline (counted in env/failed); logged once",
                        self.server.base_url, detail[:1000])
        elif kind == "action failure":
            log.warning("OpenEnv environment at %s: a step failed after the model's action while the server stayed "
                        "healthy (%s); the model's failure: the episode ended there, scores args.action_failure_reward "
                        "%g and is trained on (args.action_failures: environment makes it the environment's); "
                        "logged once", self.server.base_url, detail[:1000], self.args.action_failure_reward)
        else:
            log.warning("OpenEnv environment at %s: %s (%s); the episode ended there with the rewards it had; "
                        "logged once", self.server.base_url, kind, detail[:1000])

    def unavailable(self) -> str | None:
        """Why the server does not answer `GET /health` now, or None (also before it was first reached)."""
        http = self.server.http
        if http is None:
            return None
        try:
            r = http.get(f"{self.server.base_url}/health")
        except httpx.HTTPError as exc:
            return f"OpenEnv environment at {self.server.base_url}: {type(exc).__name__}: {exc}"
        return None if r.status_code == 200 else f"OpenEnv environment at {self.server.base_url}: HTTP {r.status_code}"

    def score_rollouts(self, example: Example, rollouts: list[Any]) -> list[float]:
        """Each rollout's episode reward (`args.reward`; `args.action_failure_reward` for an episode whose action
        failed its step); NaN for a failed episode (or a rollout without one)."""
        return [r.environment.total(self.args.reward, self.args.action_failure_reward)
                if isinstance(r.environment, Episode) else float("nan") for r in rollouts]

    def reward(self, example: Example, completion: str) -> float:
        raise ValueError("an OpenEnv environment scores episodes (the server's step rewards), not a completion's "
                         "text; its rollouts run through the tool loop")
