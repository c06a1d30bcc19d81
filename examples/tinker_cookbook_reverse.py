"""tinker-cookbook's training loops on reverse-text, against `tidal serve-tinker` (docs/tinker.md).

The cookbook (PyPI tinker-cookbook 0.6.1) trains through the official tinker SDK; this file gives its RL loop
(`tinker_cookbook.rl.train`) an environment and its supervised loop (`tinker_cookbook.supervised.train`) a data file,
both offline (no Hub dataset): tidal's reverse-text task (`tidal.envs.reverse_text`), rendered with the cookbook's
`qwen3_instruct` renderer, which writes the bundled model's ChatML template token for token.

    # terminal 1
    tidal serve-tinker --model tidal:tiny-reverse --api-key tml-local-secret
    # terminal 2 (the model name is the path the server prints)
    export TINKER_BASE_URL=http://127.0.0.1:8900 TINKER_API_KEY=tml-local-secret
    python examples/tinker_cookbook_reverse.py rl model_name=/path/to/tiny-reverse log_path=/tmp/cookbook-rl
    python examples/tinker_cookbook_reverse.py sft-data /tmp/tidal-reverse.jsonl 64
    python examples/tinker_cookbook_reverse.py sl model_name=/path/to/tiny-reverse log_path=/tmp/cookbook-sl

`rl` takes any key of `tinker_cookbook.rl.train.Config` (chz syntax, `key=value`; `dataset_builder.*` sets the
groups per batch, the group size, the number of batches and the seed), `sl` any key of
`tinker_cookbook.supervised.train.Config` (`dataset_builder.file_path` the JSONL file). The cookbook's own
`python -m tinker_cookbook.supervised.train` entry point fails in 0.6.1 before it starts ("Nested entrypoints must
take a type annotated argument"), hence `sl` here. Simplification: one prompt per group, one
turn per episode, the reward is reverse-text's similarity (the cookbook's format bonus is not used).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import chz
import tinker
from tinker_cookbook import renderers
from tinker_cookbook.rl import train
from tinker_cookbook.rl.types import (
    Action,
    ActionExtra,
    Env,
    EnvGroupBuilder,
    Observation,
    RLDataset,
    RLDatasetBuilder,
    StepResult,
)
from tinker_cookbook.supervised import train as sl_train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

from tidal.envs.base import Example
from tidal.envs.reverse_text import ReverseText

RENDERER = "qwen3_instruct"  # `<|im_start|>role\n…<|im_end|>\n`: the bundled model's template


class ReverseTextEnv(Env):
    """One reverse-text episode: the chat prompt in, one answer out, scored by tidal's reward."""

    def __init__(self, renderer: renderers.Renderer, example: Example) -> None:
        self.renderer, self.example = renderer, example

    async def initial_observation(self) -> tuple[Observation, list[int] | list[str]]:
        return self.renderer.build_generation_prompt(self.example.prompt), self.renderer.get_stop_sequences()

    async def step(self, action: Action, *, extra: ActionExtra | None = None) -> StepResult:
        message, _ = self.renderer.parse_response(action)
        reward = ReverseText().reward(self.example, renderers.get_text_content(message))
        return StepResult(reward=reward, episode_done=True, next_observation=tinker.ModelInput.empty(),
                          next_stop_condition=self.renderer.get_stop_sequences(), metrics={"similarity": reward})


@dataclass(frozen=True)
class ReverseTextGroup(EnvGroupBuilder):
    """`group_size` episodes of one example (GRPO centres rewards within a group). Picklable: names, not objects."""

    model_name: str
    example: Example
    group_size: int

    async def make_envs(self) -> Sequence[Env]:
        renderer = renderers.get_renderer(RENDERER, get_tokenizer(self.model_name))
        return [ReverseTextEnv(renderer, self.example) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return ["reverse_text"]


class ReverseTextDataset(RLDataset):
    """`n_batches` batches of `groups` groups; batch i is the same whatever order batches are asked in."""

    def __init__(self, model_name: str, groups: int, group_size: int, n_batches: int, seed: int) -> None:
        self.model_name, self.groups, self.group_size = model_name, groups, group_size
        self.n_batches, self.seed = n_batches, seed

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        rng = random.Random(self.seed * 1_000_003 + index)
        env = ReverseText()
        return [ReverseTextGroup(self.model_name, env.sample(rng), self.group_size) for _ in range(self.groups)]

    def __len__(self) -> int:
        return self.n_batches


@chz.chz
class ReverseTextBuilder(RLDatasetBuilder):
    """The cookbook's dataset builder for reverse-text (a training set only)."""

    model_name_for_tokenizer: str
    groups: int = 8
    group_size: int = 8
    n_batches: int = 10
    seed: int = 0

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        return ReverseTextDataset(self.model_name_for_tokenizer, self.groups, self.group_size,
                                  self.n_batches, self.seed), None


def _model(argv: list[str], cmd: str) -> str:
    model = next((a.split("=", 1)[1] for a in argv if a.startswith("model_name=")), None)
    if model is None:
        sys.exit(f"tinker_cookbook_reverse.py {cmd}: model_name=... is required (the name `tidal serve-tinker` serves)")
    return model


def rl_config(argv: list[str]) -> train.Config:
    """The cookbook's RL Config with reverse-text defaults; `key=value` arguments override them."""
    model = _model(argv, "rl")
    defaults = {
        "model_name": model, "recipe_name": "tidal_reverse_text", "renderer_name": RENDERER,
        "dataset_builder": ReverseTextBuilder, "dataset_builder.model_name_for_tokenizer": model,
        "learning_rate": 2e-3, "max_tokens": 48, "lora_rank": 16, "eval_every": 0, "save_every": 0,
        "log_path": "/tmp/tidal-cookbook-rl",
    }
    return chz.Blueprint(train.Config).apply(defaults).make_from_argv(argv)


def sl_config(argv: list[str]) -> sl_train.Config:
    """The cookbook's supervised Config over the cookbook's own `FromConversationFileBuilder` (a JSONL file of
    conversations: `sft-data` writes one); `key=value` arguments override the defaults."""
    model = _model(argv, "sl")
    common = "dataset_builder.common_config."
    defaults = {
        "model_name": model, "recipe_name": "tidal_reverse_text_sl", "renderer_name": RENDERER,
        "dataset_builder": FromConversationFileBuilder, "dataset_builder.file_path": "/tmp/tidal-reverse.jsonl",
        common + "model_name_for_tokenizer": model, common + "renderer_name": RENDERER,
        common + "batch_size": 16, common + "max_length": 256,
        "learning_rate": 3e-3, "lora_rank": 16, "eval_every": 0, "save_every": 0, "log_path": "/tmp/tidal-cookbook-sl",
    }
    return chz.Blueprint(sl_train.Config).apply(defaults).make_from_argv(argv)


def write_sft_jsonl(path: str, n: int, seed: int = 0) -> None:
    """`n` reverse-text conversations (system, user, the reference answer) in the cookbook's JSONL format."""
    env, rng = ReverseText(), random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            ex = env.sample(rng)
            messages = [*ex.prompt, {"role": "assistant", "content": env.reference_completion(ex)}]
            f.write(json.dumps({"messages": messages}) + "\n")


if __name__ == "__main__":
    match sys.argv[1:2]:
        case ["rl"]:
            asyncio.run(train.main(rl_config(sys.argv[2:])))
        case ["sl"]:
            asyncio.run(sl_train.main(sl_config(sys.argv[2:])))
        case ["sft-data"] if len(sys.argv) == 4:
            write_sft_jsonl(sys.argv[2], int(sys.argv[3]))
        case _:
            sys.exit("usage: tinker_cookbook_reverse.py rl|sl key=value ... | sft-data PATH N")
