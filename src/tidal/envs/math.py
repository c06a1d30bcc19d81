"""math: arithmetic word problems (generated) or the user's own math data, answers checked by `math-verify`.

Prompt: a system message asking for the final answer in `\\boxed{}` and the problem. Reward: 1.0 when
`math_verify.verify(parse(gold), parse(completion))` holds (so `\\boxed{0.5}` matches a gold `1/2`), else 0.0.

Data: by default problems are generated from templates with the orchestrator's RNG (numbers up to
`max_operand`, one or two operations), so nothing is downloaded and no example repeats systematically. With
`data_files` (a local `.jsonl`, `.json`, `.csv` or `.parquet` file, or a list of them) the examples are that
dataset, loaded with Hugging Face `datasets`; `question_key` / `answer_key` name its columns, and the whole
file is also the finite eval set (`eval.num_examples: -1`).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from tidal.envs.base import Environment, Example

SYSTEM_PROMPT = "Solve the problem. Put only the final answer inside \\boxed{}."
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Femi", "Gus", "Hana"]
ITEMS = ["apples", "marbles", "stickers", "coins", "books", "shells"]


def check(gold: str, completion: str) -> float:
    """1.0 when math-verify finds the completion's answer equal to `gold`. math-verify's own timeouts use
    SIGALRM, which only works in the main thread; rewards run in worker threads (the orchestrator's reward
    timeout, the environment server), so they are off here and `reward_timeout_s` bounds the call instead."""
    from math_verify import parse, verify

    try:
        return 1.0 if verify(parse(f"${gold}$", parsing_timeout=None), parse(completion, parsing_timeout=None),
                             timeout_seconds=None) else 0.0
    except Exception:  # noqa: BLE001 - an unparsable completion scores 0
        return 0.0


class MathProblems(Environment):
    id = "math"

    def __init__(self, data_files: str | list[str] | None = None, question_key: str = "question",
                 answer_key: str = "answer", max_operand: int = 20) -> None:
        if max_operand < 2:
            raise ValueError(f"math: max_operand must be >= 2, got {max_operand}")
        self.max_operand = max_operand
        self.rows: list[dict[str, Any]] | None = None
        if data_files is not None:
            self.rows = load_rows(data_files, question_key, answer_key)

    def _example(self, question: str, answer: str, info: dict[str, Any] | None = None) -> Example:
        return Example(prompt=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
                       answer=answer, info=info or {})

    def sample(self, rng: random.Random) -> Example:
        if self.rows is not None:
            row = self.rows[rng.randrange(len(self.rows))]
            return self._example(row["question"], row["answer"])
        return self._example(*self.generate(rng))

    def generate(self, rng: random.Random) -> tuple[str, str]:
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b, c = (rng.randint(1, self.max_operand) for _ in range(3))
        kind = rng.randrange(4)
        if kind == 0:
            return f"{name} has {a} {item} and finds {b} more. How many {item} does {name} have now?", str(a + b)
        if kind == 1:
            a = a + b
            return f"{name} has {a} {item} and gives away {b}. How many {item} are left?", str(a - b)
        if kind == 2:
            return f"{name} buys {a} bags with {b} {item} in each. How many {item} is that?", str(a * b)
        return (f"{name} has {a} boxes of {b} {item} and gets {c} more {item}. How many {item} in all?",
                str(a * b + c))

    def reward(self, example: Example, completion: str) -> float:
        return check(example.answer, completion)

    def reference_completion(self, example: Example) -> str:
        return f"\\boxed{{{example.answer}}}"

    def eval_examples(self) -> list[Example] | None:
        if self.rows is None:
            return None
        return [self._example(r["question"], r["answer"]) for r in self.rows]


def load_rows(data_files: str | list[str], question_key: str, answer_key: str) -> list[dict[str, Any]]:
    """Rows of local data files through Hugging Face `datasets` (no network: local files only)."""
    from datasets import load_dataset

    files = [data_files] if isinstance(data_files, str) else list(data_files)
    for f in files:
        if not Path(f).is_file():
            raise ValueError(f"math: data file {f} does not exist (data_files takes local files only)")
    suffix = Path(files[0]).suffix.lower()
    builder = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}.get(suffix)
    if builder is None:
        raise ValueError(f"math: {files[0]}: unsupported file type '{suffix}' (use .jsonl, .json, .csv, .parquet)")
    ds = load_dataset(builder, data_files=files, split="train")
    missing = [k for k in (question_key, answer_key) if k not in ds.column_names]
    if missing:
        raise ValueError(f"math: {files[0]} has no column {missing[0]!r} (columns: {', '.join(ds.column_names)}); "
                         f"set question_key / answer_key")
    rows = [{"question": str(r[question_key]), "answer": str(r[answer_key])} for r in ds]
    if not rows:
        raise ValueError(f"math: {files[0]} holds no rows")
    return rows
