"""OpenEnv environments: an OpenEnv server (openenv-core 0.3, the optional `openenv` extra) as a tidal environment.

`env: [{id: "tidal.envs.openenv:OpenEnv", args: {base_url: ..., max_turns: ...}}]` (or `args.app`: an ASGI app's
import path, served by tidal). The modules, imported one way: `env` (the Environment: examples, scoring) ->
`session` (one WebSocket episode per rollout inside the tool loop) and `server` (starting / reaching the server,
the stateless HTTP reset). openenv-core is imported only when an episode opens its session, so tidal imports and
runs without it; building the environment without it is an error naming the extra.
"""

from tidal.envs.openenv.env import OpenEnv
from tidal.envs.openenv.session import Episode

__all__ = ["Episode", "OpenEnv"]
