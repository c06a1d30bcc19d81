"""The `dataset` environment: local files of every format, directories with splits, `save_to_disk` output,
column selection, standard and conversational prompts, the eval split, and errors that name the file and key.
No network: local files only."""

from __future__ import annotations

import json
import random

import pytest

from tidal.envs import make_env
from tidal.envs.dataset import DatasetEnv

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
ROWS = [{"prompt": f"Question {i}:", "answer": str(i), "level": i % 3} for i in range(6)]


def write(tmp_path, fmt: str, rows: list[dict], name: str = "data") -> str:
    import datasets

    path = tmp_path / f"{name}.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    else:
        ds = datasets.Dataset.from_list(rows)
        if fmt == "csv":
            ds.to_csv(str(path), index=False)
        elif fmt == "parquet":
            ds.to_parquet(str(path))
        else:  # arrow: one arrow stream file, as datasets writes its cache
            from datasets.arrow_writer import ArrowWriter

            with ArrowWriter(path=str(path)) as w:
                for r in rows:
                    w.write(r)
                w.finalize()
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "arrow"])
def test_every_file_format_loads_standard_prompts_and_columns(tmp_path, fmt):
    env = make_env("dataset", {"path": write(tmp_path, fmt, ROWS)})
    assert isinstance(env, DatasetEnv) and not env.has_reward
    examples = env.eval_examples()
    assert examples is not None and [e.prompt for e in examples] == [r["prompt"] for r in ROWS]
    ex = examples[4]
    assert isinstance(ex.prompt, str)
    cols = env.reward_columns(ex)
    assert set(cols) == {"answer", "level"} and str(cols["answer"]) == "4" and int(cols["level"]) == 1
    drawn = env.sample(random.Random(0))
    assert drawn.prompt in [r["prompt"] for r in ROWS]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_conversational_prompts_stay_message_lists(tmp_path, fmt):
    rows = [{"prompt": CHAT, "solution": "4"}, {"prompt": [{"role": "user", "content": "hi"}], "solution": "x"}]
    env = make_env("dataset", {"path": write(tmp_path, fmt, rows)})
    examples = env.eval_examples()
    assert examples is not None
    assert examples[0].prompt == CHAT and examples[1].prompt == [{"role": "user", "content": "hi"}]
    assert env.reward_columns(examples[0]) == {"solution": "4"}  # exactly the dataset's other columns


def test_directory_splits_eval_split_and_column_selection(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (d / "test.jsonl").write_text(json.dumps({"prompt": "held out", "answer": "9", "level": 0}) + "\n")
    env = make_env("dataset", {"path": str(d), "eval_split": "test", "columns": ["answer"]})
    assert [e.prompt for e in env.eval_examples() or []] == ["held out"]
    assert len(env.rows) == 6 and env.reward_columns(env.sample(random.Random(1))).keys() == {"answer"}
    test_only = make_env("dataset", {"path": str(d), "split": "test"})
    assert [e.prompt for e in test_only.eval_examples() or []] == ["held out"]


def test_save_to_disk_directories_and_prompt_column(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"question": "a?", "gt": "1"}]),
                               "validation": datasets.Dataset.from_list([{"question": "b?", "gt": "2"}])})
    dd.save_to_disk(str(tmp_path / "dd"))
    env = make_env("dataset", {"path": str(tmp_path / "dd"), "prompt_column": "question",
                               "eval_split": "validation"})
    assert env.sample(random.Random(0)).prompt == "a?"
    ev = env.eval_examples() or []
    assert [e.prompt for e in ev] == ["b?"] and env.reward_columns(ev[0]) == {"gt": "2"}


def test_reference_completions_come_from_a_completion_column(tmp_path):
    env = make_env("dataset", {"path": write(tmp_path, "jsonl", [{"prompt": "p", "completion": " done"}])})
    assert env.reference_completion(env.sample(random.Random(0))) == " done"
    plain = make_env("dataset", {"path": write(tmp_path, "jsonl", ROWS, "plain")})
    with pytest.raises(NotImplementedError, match="no 'completion' column"):
        plain.reference_completion(plain.sample(random.Random(0)))


def test_errors_name_the_file_and_what_is_valid(tmp_path):
    path = write(tmp_path, "jsonl", ROWS)
    with pytest.raises(ValueError, match=r"no column 'question'.*columns: prompt, answer, level.*prompt_column"):
        make_env("dataset", {"path": path, "prompt_column": "question"})
    with pytest.raises(ValueError, match=r"no column 'nope'.*fix columns"):
        make_env("dataset", {"path": path, "columns": ["nope"]})
    with pytest.raises(ValueError, match=r"single file.*split 'train' only"):
        make_env("dataset", {"path": path, "split": "test"})
    bad = tmp_path / "data.txt"
    bad.write_text("x")
    with pytest.raises(ValueError, match=r"unsupported file type '\.txt'"):
        make_env("dataset", {"path": str(bad)})
    with pytest.raises(ValueError, match="does not exist"):
        make_env("dataset", {"path": str(tmp_path / "missing.jsonl")})
    numbers = write(tmp_path, "jsonl", [{"prompt": 3}], "numbers")
    with pytest.raises(ValueError, match=r"row 0: prompt must be a string \(standard format\) or"):
        make_env("dataset", {"path": numbers})
    with pytest.raises(NotImplementedError, match="no reward of its own"):
        make_env("dataset", {"path": path}).reward(DatasetEnv.example(ROWS[0]), "x")


def test_sft_renders_standard_prompts_as_plain_text_and_chat_with_the_template():
    from tidal.models.sources import bundled
    from tidal.trainer.model.load import load_tokenizer
    from tidal.trainer.sft import render_prompt

    tok = load_tokenizer(bundled("tidal:tiny-reverse"))
    plain = render_prompt(tok, "abc def")
    assert plain == list(tok("abc def", add_special_tokens=False)["input_ids"])
    assert render_prompt(tok, [{"role": "user", "content": "abc def"}]) != plain
