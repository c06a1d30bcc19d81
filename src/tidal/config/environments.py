"""Orchestrator environments (`orch.yaml` `env[]`, `eval.env[]`): where training examples come from, the tools the
model may call in them, and the `args` of an OpenEnv server."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tidal.config.agent import AgentArgs
from tidal.config.base import StrictModel


class ToolsSection(StrictModel):
    """Tool calling in the model's own chat format (`tidal.envs.tools`): the tools' JSON schemas go to the chat
    template (`tools=`), each model turn's tool calls are parsed and run, and their results come back as `tool`
    messages (tokens with no loss) until the model answers without a call or `max_iterations` is reached. Needs
    conversational prompts and a chat template that renders tools."""

    functions: list[str] = Field(default_factory=list)
    """Tool functions as import paths (`package.module:function`): type-hinted, with a Google-style docstring."""
    environment_factory: str | None = None
    """TRL's `environment_factory` as an import path (`package.module:Class`): one instance per rollout,
    `reset(**row)` with the example's columns, its public methods are tools, an optional `get_reward()` is a
    reward column named after the class."""
    format: Literal["auto", "hermes", "mistral", "llama3_json"] = "auto"
    """How the model writes tool calls: `hermes` (`<tool_call>{json}</tool_call>`, Qwen), `mistral`
    (`[TOOL_CALLS][...]`), `llama3_json` (a bare `{"name", "parameters"}` object), `auto`: whichever appears."""
    max_iterations: int | None = Field(None, ge=0)
    """Most tool-calling rounds per rollout (TRL's `max_tool_calling_iterations`); null: until the token budget
    ends the rollout."""

    @model_validator(mode="after")
    def _some_tools(self) -> ToolsSection:
        if not self.functions and self.environment_factory is None:
            raise ValueError("tools: give functions (import paths) or an environment_factory")
        return self


class OpenEnvArgs(StrictModel):
    """`args` of an OpenEnv environment (`id: tidal.envs.openenv:OpenEnv`, `tidal.envs.openenv`): an OpenEnv server
    (openenv-core 0.3, `pip install 'tidal[openenv]'`) reached at `base_url` or started by tidal from `app`. Each
    example is `reset(seed)`; the model's turns are the actions (`step`), the observations come back as user messages,
    and the episode's step rewards are the reward, until `done` or `max_turns`."""

    base_url: str | None = None
    """`http://host:port` of a running OpenEnv server (its HTTP `/reset` and WebSocket `/ws` routes)."""
    app: str | None = None
    """The server's ASGI app as an import path (`package.module:app`, what `create_app(...)` returned): tidal serves
    it with uvicorn on a free localhost port and stops it with the run. Set this or `base_url`."""
    max_turns: int = Field(1, ge=1)
    """Model turns (actions) per episode; the episode also ends when the server says `done`."""
    action_field: str = "message"
    """The action's field that gets the model's turn text (`{action_field: text}`)."""
    action_parser: str | None = None
    """Import path of `fn(text) -> dict` building the action from the turn's text (replaces `action_field`); a
    ValueError means an invalid action (the episode ends there)."""
    observation_template: str | None = None
    """`str.format` template over the observation's fields giving the user message (e.g. `"{prompt}"`); null: the
    observation's only string field, or all its fields as JSON."""
    system_prompt: str | None = None
    """A system message before the first observation (null: none)."""
    reset_args: dict[str, Any] = Field(default_factory=dict)
    """More keyword arguments of every `reset` besides `seed` (the environment's own, e.g. a difficulty)."""
    reward: Literal["sum", "last"] = "sum"
    """The episode's reward: the sum of its step rewards, or the last step's (a null reward counts as 0)."""
    max_sessions: int = Field(1, ge=1)
    """Episodes open at once (WebSocket sessions); at most the server's `max_concurrent_envs` (1 unless its
    environment sets `SUPPORTS_CONCURRENT_SESSIONS` and the app raises it)."""
    timeout_s: float = Field(60.0, gt=0)
    """Seconds per request to the server (a reset, a step); a request past it fails the episode."""
    action_failures: Literal["model", "environment"] = "model"
    """Whose failure a `step` is that fails after the model's action (timed out, a server error, a dropped
    connection): `model`: the model's (its action hung or broke the environment: the episode scores
    `action_failure_reward` and is trained on), unless the server's `/health` fails at that moment (then the
    environment's); `environment`: always the environment's (not judged: no loss, out of the group's baseline, an
    outage when most episodes fail so). A failed `reset` is always the environment's."""
    action_failure_reward: float = 0.0
    """The reward of an episode whose step failed on the model's action (`action_failures: model`), in place of its
    step rewards: 0.0 is orch `reward_default`'s default; a negative value penalises actions that break the
    environment."""
    startup_timeout_s: float = Field(60.0, gt=0)
    """Seconds to wait for the server's `/health` when the run starts (and for `app` to come up)."""

    @model_validator(mode="after")
    def _one_server(self) -> OpenEnvArgs:
        if (self.base_url is None) == (self.app is None):
            raise ValueError("set base_url (a running OpenEnv server) or app (an import path tidal serves), "
                             "exactly one")
        if "seed" in self.reset_args:
            raise ValueError("reset_args may not set seed: tidal draws each episode's seed from the run's RNG")
        return self

    @field_validator("app", "action_parser")
    @classmethod
    def _import_path(cls, value: str | None) -> str | None:
        module, sep, name = (value or "m:n").partition(":")
        if not (module and sep and name):
            raise ValueError(f"'{value}' is not an import path 'package.module:name'")
        return value


class LongTailArgs(StrictModel):
    """`args` of the `reverse-text-longtail` environment (`tidal.envs.longtail`): reverse a text of k letters, with k
    drawn from a heavy-tailed distribution, so that most completions stop early and a few run long (the workload of
    `async_mode: in_flight`, docs/orchestrator.md). The text repeats a random unit of letters, so its length, not
    its content, is what the model must get right: it learns to stop after k letters."""

    distribution: Literal["lognormal", "pareto"] = "lognormal"
    """The law of the text length k (letters): `lognormal` (`median`, `sigma`) or `pareto` (`min_len`, `alpha`:
    P(k > x) = (min_len / x) ** alpha); k is rounded to the nearest integer and clipped to [`min_len`, `max_len`]."""
    median: float = Field(8.0, gt=0)
    """`lognormal`: the median length, letters (the law's mu = ln(median))."""
    sigma: float = Field(1.25, gt=0)
    """`lognormal`: the standard deviation of ln(k); larger means a heavier tail (1.25 with median 8: ~5% of
    texts are longer than 64 letters)."""
    alpha: float = Field(1.5, gt=0)
    """`pareto`: the tail index; smaller means a heavier tail (<= 2: infinite variance before clipping)."""
    min_len: int = Field(2, ge=1)
    """Shortest text (letters); the Pareto law's scale."""
    max_len: int = Field(200, ge=1)
    """Longest text (letters): longer draws are clipped to it (keep it under `sampling.max_tokens` - 3, or the
    longest answers cannot be completed)."""
    unit: int = Field(2, ge=1, le=8)
    """The text repeats a random unit of 1..`unit` lowercase letters (`aaaa`, `abab`...)."""

    @model_validator(mode="after")
    def _range(self) -> LongTailArgs:
        if self.min_len > self.max_len:
            raise ValueError(f"min_len ({self.min_len}) must not exceed max_len ({self.max_len})")
        return self


ShapeTask = Literal["colour", "shape", "count"]
SHAPE_TASKS: tuple[ShapeTask, ...] = ("colour", "shape", "count")
"""The questions of `visual-shapes` (`VisualShapesArgs.tasks`)."""
KINDS_PER_IMAGE = 4
"""`visual-shapes`' colour and shape tasks draw each of its 4 shape kinds at most once."""


class VisualShapesArgs(StrictModel):
    """`args` of the `visual-shapes` environment (`tidal.envs.shapes`): a generated image of coloured shapes
    (squares, circles, triangles, diamonds on white; Pillow, no download) and one question about it, for any
    vision-language model. The run's RNG draws every image, so a seed reproduces them."""

    tasks: list[ShapeTask] = Field(default_factory=lambda: list(SHAPE_TASKS), min_length=1)
    """The task mix: each example asks one of these, drawn uniformly (list one twice to double its share).
    `colour`: "What colour is the triangle?" (each kind at most once, each shape its own colour); `shape`:
    "Which shape is red?" (the same images); `count`: "How many shapes are in the image?" (any kinds and
    colours)."""
    image_size: int = Field(224, ge=32, le=2048)
    """Side of the square image, pixels (224: 64 image tokens for Qwen2.5-VL / Qwen3-VL's 28-pixel merged
    patches; the model's processor resizes it as it would any image)."""
    min_shapes: int = Field(1, ge=1, le=9)
    """Fewest shapes in an image."""
    max_shapes: int = Field(4, ge=1, le=9)
    """Most shapes in an image (the `colour` and `shape` tasks draw at most 4: one of each kind). Shapes sit in
    the cells of a grid of ceil(sqrt(max_shapes)) x as many cells, one per cell, so they never touch."""

    @model_validator(mode="after")
    def _range(self) -> VisualShapesArgs:
        if self.min_shapes > self.max_shapes:
            raise ValueError(f"min_shapes ({self.min_shapes}) must not exceed max_shapes ({self.max_shapes})")
        kinds_only = [t for t in self.tasks if t != "count"]
        if kinds_only and self.min_shapes > KINDS_PER_IMAGE:
            raise ValueError(f"tasks {sorted(set(kinds_only))} draw at most {KINDS_PER_IMAGE} shapes (one of each "
                             f"kind), but min_shapes is {self.min_shapes}: lower it or use tasks: [count]")
        return self


def check_args(model: type[StrictModel], what: str, args: dict[str, Any]) -> Any:
    """`args` validated as `model`; a ValueError names `what` and each bad key (`args.KEY: why`)."""
    from pydantic import ValidationError

    try:
        return model.model_validate(args)
    except ValidationError as exc:
        bad = "; ".join(f"args{''.join('.' + str(p) for p in e['loc'])}: {e['msg'].removeprefix('Value error, ')}"
                        for e in exc.errors())
        raise ValueError(f"{what}: {bad} (keys: {', '.join(model.model_fields)})") from None


LONGTAIL_IDS = ("reverse-text-longtail",)
"""`env[].id`s of the long-tail environment (its `args` are `LongTailArgs`)."""
SHAPES_IDS = ("visual-shapes",)
"""`env[].id`s of the generated-image environment (its `args` are `VisualShapesArgs`)."""


OPENENV_IDS = ("tidal.envs.openenv:OpenEnv", "openenv")
"""`env[].id`s of the OpenEnv environment (its `args` are `OpenEnvArgs`); the short `openenv` works once
`tidal.envs.registry` lists the class under its `id` (not yet: use the import path)."""


def check_openenv_args(args: dict[str, Any]) -> OpenEnvArgs:
    """`args` as `OpenEnvArgs`; a ValueError names each bad key (`args.KEY: why`)."""
    return check_args(OpenEnvArgs, "OpenEnv environment", args)


class EnvSection(StrictModel):
    """One environment to sample training examples from."""

    id: str
    """Environment id from tidal's registry (`reverse-text`, `reverse-text-longtail`: its `args` are
    `LongTailArgs`, `visual-shapes`: generated images for vision-language models, its `args` are
    `VisualShapesArgs`, `math`, `calculator`, `dataset`, `openenv`: an OpenEnv server, its `args` in
    docs/orchestrator.md, `agent`: a user's own agent program, its `args` are `tidal.config.agent.AgentArgs`,
    docs/agents.md) or `package.module:Class`."""
    name: str | None = None
    """Name in metrics and `Example.task` (null: the id); tells apart two entries with the same id."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Environment-specific keyword arguments."""
    address: str | None = None
    """`http://host:port` of a running `tidal env-server` serving this environment (null: not remote)."""
    spawn: bool = False
    """Run the environment in a `tidal env-server` subprocess started by the orchestrator (null address and
    false: in process)."""
    tools: ToolsSection | None = None
    """Tools the model may call in this environment's rollouts (null: the environment's own, if any)."""

    @model_validator(mode="after")
    def _one_place(self) -> EnvSection:
        if self.address is not None and self.spawn:
            raise ValueError(f"env '{self.name or self.id}': set address (a running server) or spawn, not both")
        if self.id in OPENENV_IDS:
            if self.address is not None or self.spawn:
                raise ValueError(f"env '{self.name or self.id}': an OpenEnv server is given by args.base_url or "
                                 f"args.app, not address/spawn (those serve tidal's own environments)")
            check_openenv_args(self.args)
        if self.id == "agent":
            if self.address is not None or self.spawn or self.tools is not None:
                raise ValueError(f"env '{self.name or self.id}': the agent environment runs in the orchestrator "
                                 f"with the program's own tools; address, spawn and tools do not apply")
            check_args(AgentArgs, f"env '{self.name or self.id}'", self.args)
        if self.id in LONGTAIL_IDS:
            check_args(LongTailArgs, f"env '{self.name or self.id}'", self.args)
        if self.id in SHAPES_IDS:
            check_args(VisualShapesArgs, f"env '{self.name or self.id}'", self.args)
        return self
