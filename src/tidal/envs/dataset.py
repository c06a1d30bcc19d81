"""dataset: any Hugging Face `datasets` dataset with a `prompt` column, as TRL's GRPOTrainer reads it.

`env: [{id: dataset, args: {path: data/train.jsonl}}]`. `path` is a local `.jsonl`, `.json`, `.csv`,
`.parquet` or `.arrow` file, a local directory (data files whose names give the splits, e.g. `train.jsonl` and
`test.jsonl`, or a `Dataset.save_to_disk` directory), or a Hub dataset name (`org/name`, downloaded by
`datasets`). `split` picks the training split, `eval_split` the finite evaluation set (`eval_examples`; unset:
the training rows), `columns` keeps only some columns, `prompt_column` names the prompt.

Prompt formats (TRL's): *standard* — `prompt` is a string, sent to the model as plain text with no chat
template (tokenized without special tokens, as TRL does); *conversational* — `prompt` is a list of
`{"role", "content"}` messages, rendered with the model's chat template and the generation prompt.

Rewards: the environment has none of its own (`has_reward = False`): completions are scored by the run's reward
functions (orch `reward_funcs`, or `GRPOTrainer(reward_funcs=...)`), which get every column but `prompt` as a
keyword argument, one value per completion (`reward_columns`). A `completion` column, when present, is the
reference completion `tidal sft` warm-starts on.

Sampling draws rows uniformly with the orchestrator's RNG (the buffer keeps one batch free of duplicates).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from tidal.envs.base import Environment, Example

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
"""File suffix -> the `datasets` builder that reads it."""


def load_split(path: str, split: str, name: str | None = None) -> Any:
    """Split `split` of the dataset at `path` (file, directory or Hub name) as a `datasets.Dataset`."""
    import datasets

    p = Path(path).expanduser()
    if p.is_file():
        builder = FILE_BUILDERS.get(p.suffix.lower())
        if builder is None:
            raise ValueError(f"dataset: {path}: unsupported file type '{p.suffix}' (use "
                             f"{', '.join(FILE_BUILDERS)}, a directory, or a Hub dataset name)")
        if split != "train":
            raise ValueError(f"dataset: {path} is a single file, which holds split 'train' only (got split "
                             f"'{split}'); put the splits in a directory (train.jsonl, test.jsonl) or give the "
                             f"evaluation file its own eval env entry")
        return datasets.load_dataset(builder, data_files=str(p), split="train")
    if p.is_dir():
        if (p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file():  # save_to_disk
            loaded = datasets.load_from_disk(str(p))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise ValueError(f"dataset: {path} has no split '{split}' (splits: {', '.join(loaded)})")
                return loaded[split]
            if split != "train":
                raise ValueError(f"dataset: {path} holds one dataset (split 'train' only), not split '{split}'")
            return loaded
        try:
            return datasets.load_dataset(str(p), name, split=split)
        except ValueError as exc:  # e.g. an unknown split: datasets names the ones there are
            raise ValueError(f"dataset: {path}: {exc}") from None
    if path.startswith((".", "/", "~")) or path.count("/") > 1 or p.suffix.lower() in FILE_BUILDERS:
        raise ValueError(f"dataset: path {path} does not exist (give a local file or directory, or a Hub dataset "
                         f"name like org/name)")
    return datasets.load_dataset(path, name, split=split)  # a Hub dataset name


def check_prompt(prompt: Any, where: str) -> str | list[dict[str, Any]]:
    """A standard (string) or conversational (list of role/content messages) prompt; anything else raises."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
        return [{k: v for k, v in m.items() if v is not None} for m in prompt]  # parquet fills absent keys
    raise ValueError(f"{where}: prompt must be a string (standard format) or a non-empty list of "
                     f"{{'role': ..., 'content': ...}} messages (conversational format), got {type(prompt).__name__}"
                     f" {str(prompt)[:80]!r}")


def rows_of(ds: Any, where: str, prompt_column: str, columns: list[str] | None) -> list[dict[str, Any]]:
    """The rows of `ds` with the prompt under `prompt` and only `columns` (None: all) beside it."""
    names = list(ds.column_names)
    if prompt_column not in names:
        raise ValueError(f"{where} has no column '{prompt_column}' (columns: {', '.join(names)}); set "
                         f"prompt_column")
    keep = names if columns is None else [prompt_column, *[c for c in columns if c != prompt_column]]
    missing = [c for c in keep if c not in names]
    if missing:
        raise ValueError(f"{where} has no column '{missing[0]}' (columns: {', '.join(names)}); fix columns")
    rows = []
    for i, row in enumerate(ds.select_columns(keep)):
        out = {k: v for k, v in row.items() if k != prompt_column}
        out["prompt"] = check_prompt(row[prompt_column], f"{where}, row {i}")
        rows.append(out)
    if not rows:
        raise ValueError(f"{where} holds no rows")
    return rows


class DatasetEnv(Environment):
    """Rows of a `datasets` dataset; the reward comes from the run's reward functions."""

    id = "dataset"
    has_reward = False

    def __init__(self, path: str, split: str = "train", eval_split: str | None = None, name: str | None = None,
                 prompt_column: str = "prompt", columns: list[str] | None = None) -> None:
        """`path`: file, directory or Hub name; `split` / `eval_split`: training / evaluation split; `name`: the
        dataset's configuration (Hub datasets with several); `prompt_column`: the prompt's column; `columns`:
        the other columns to keep (None: all)."""
        self.path = path
        self.rows = rows_of(load_split(path, split, name), f"dataset {path} (split {split})", prompt_column,
                            columns)
        self.eval_rows = (rows_of(load_split(path, eval_split, name), f"dataset {path} (split {eval_split})",
                                  prompt_column, columns) if eval_split is not None else None)

    @staticmethod
    def example(row: dict[str, Any]) -> Example:
        info = {k: v for k, v in row.items() if k != "prompt"}
        return Example(prompt=row["prompt"], answer=str(info.get("answer", "")), info=info)

    def sample(self, rng: random.Random) -> Example:
        return self.example(self.rows[rng.randrange(len(self.rows))])

    def reward(self, example: Example, completion: str) -> float:
        raise NotImplementedError("environment 'dataset' has no reward of its own; give reward functions "
                                  "(orch reward_funcs, or GRPOTrainer(reward_funcs=...))")

    def reward_columns(self, example: Example) -> dict[str, Any]:
        return dict(example.info)  # exactly the dataset's columns, as TRL passes them

    def eval_examples(self) -> list[Example] | None:
        return [self.example(r) for r in (self.eval_rows if self.eval_rows is not None else self.rows)]

    def reference_completion(self, example: Example) -> str:
        if "completion" not in example.info:
            raise NotImplementedError(f"dataset {self.path} has no 'completion' column (reference completions)")
        completion = example.info["completion"]
        if isinstance(completion, list):  # conversational: the assistant message(s)
            return "".join(str(m.get("content", "")) for m in completion)
        return str(completion)
