"""`GRPOTrainer`'s checks before anything starts (TRL's signature; what tidal refuses, by name), the reward
functions it hands the orchestrator (names, weights, import paths), the dataset rows it writes, and the
launcher's in-process component that runs the orchestrator in the caller's process."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from types import SimpleNamespace

import pytest

from tidal import GRPOConfig, GRPOTrainer
from tidal.api.trainer import reward_functions, write_rows
from tidal.colocate.supervise import InProcess
from tidal.envs import make_env

ROWS = [{"prompt": "abc", "answer": "cba"}, {"prompt": "de", "answer": "ed"}]


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def make(**kw):
    args = kw.pop("args", GRPOConfig(num_generations=2, per_device_train_batch_size=4))
    return GRPOTrainer(**{"model": "tidal:tiny-reverse", "reward_funcs": length, "args": args,
                          "train_dataset": ROWS, "peft_config": None, **kw})


def test_construction_derives_the_configs_full_weights_without_peft_config():
    t = make()
    assert not t.derived.train.lora, "TRL: no peft_config trains every weight"
    assert t.derived.orch.batch_size == 4 and t.derived.orch.rollouts_per_example == 2
    assert t.derived.orch.max_steps == 3  # 3 epochs x 2 rows x 2 generations / 4


@pytest.mark.parametrize(("kw", "match"), [
    ({"environment_factory": {"a": object}}, r"environment_factory=\{name: factory\}\) \(several environments\) "
                                              r"is not supported"),
    ({"rollout_func": lambda prompts, trainer: {}, "tools": [add]},
     r"rollout_func=...\) with tools= or environment_factory=: TRL runs its tool loop"),
    ({"quantization_config": object()}, r"quantization_config=...\): a bitsandbytes-quantized"),
    ({"optimizers": (object(), None)}, r"optimizers=\(object instance, None\)\): an optimizer instance"),
])
def test_unsupported_arguments_are_refused_by_name(kw, match):
    with pytest.raises(NotImplementedError, match=match):
        make(**kw)


def test_rollout_func_reaches_every_environment_of_the_run(tmp_path):
    from tidal.orchestrator.preflight import build_scoring
    from tidal.orchestrator.rollout_func import RolloutFunc

    def rollout(prompts, trainer):
        return {}

    t = make(rollout_func=rollout)
    assert isinstance(t.rollout_func, RolloutFunc) and t.rollout_func.fn is rollout
    assert t.rollout_func.args is t.args and t.rollout_func.model == "tidal:tiny-reverse"
    scoring = build_scoring(t.with_data(t.derived.orch, tmp_path), t.reward_funcs, None, t.rollout_func)
    assert [e.rollout_func for e in scoring.env.envs.values()] == [t.rollout_func]
    assert make().rollout_func is None
    with pytest.raises(TypeError, match=r"rollout_func=...\) must be a function \(prompts, trainer\) -> dict"):
        make(rollout_func="not a function")


@pytest.mark.filterwarnings("ignore:GRPOTrainer without peft_config")
def test_bad_models_datasets_and_reward_functions_are_refused():
    with pytest.raises(TypeError, match="model must be a model name or directory"):
        make(model=object())
    with pytest.raises(ValueError, match="has no 'prompt' column"):
        make(train_dataset=[{"question": "x"}])
    with pytest.raises(TypeError, match="datasets.Dataset or a list of dicts"):
        make(train_dataset="data.jsonl")
    with pytest.raises(ValueError, match=r"cannot import 'tidal_no_such_module:f'"):
        make(reward_funcs="tidal_no_such_module:f")
    with pytest.raises(ValueError, match="2 weights for 1 reward functions"):
        make(args=GRPOConfig(num_generations=2, per_device_train_batch_size=4, reward_weights=[1.0, 2.0]))
    with pytest.raises(ValueError, match="eval_strategy 'steps' needs an eval_dataset"):
        make(args=GRPOConfig(num_generations=2, per_device_train_batch_size=4, eval_strategy="steps"))


def test_eval_datasets_one_or_a_dict_of_named_ones():
    args = GRPOConfig(num_generations=2, per_device_train_batch_size=4, eval_strategy="steps")
    one = make(args=args, eval_dataset=ROWS[:1], peft_config=SimpleNamespace(r=8))
    assert list(one.eval_sets) == ["eval"] and [e.name for e in one.derived.orch.eval.env] == ["eval"]
    two = make(args=args, eval_dataset={"easy": ROWS[:1], "hard-2": ROWS}, peft_config=SimpleNamespace(r=8))
    assert [e.name for e in two.derived.orch.eval.env] == ["easy", "hard-2"] and len(two.eval_sets["hard-2"]) == 2
    with pytest.raises(ValueError, match="eval_dataset key 'a/b'"):
        make(args=args, eval_dataset={"a/b": ROWS}, peft_config=SimpleNamespace(r=8))


def test_reward_functions_get_unique_names_weights_and_import_paths():
    path = "tidal.rewards.length:soft_overlong_punishment"
    funcs = reward_functions([length, lambda **kw: [], lambda **kw: [], path], [1.0, 2.0, 3.0, 0.5])
    assert [(n, w) for n, _, w in funcs] == [("length", 1.0), ("<lambda>", 2.0), ("<lambda>_2", 3.0),
                                            ("soft_overlong_punishment", 0.5)]
    assert reward_functions(length, None)[0][2] == 1.0
    with pytest.raises(ValueError, match="reward_funcs is empty"):
        reward_functions([], None)


def test_written_rows_read_back_through_the_dataset_env(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "answer": "x", "meta": {"k": [1, 2]}}]
    write_rows(rows, tmp_path / "d" / "train.jsonl")
    env = make_env("dataset", {"path": str(tmp_path / "d" / "train.jsonl")})
    ex = (env.eval_examples() or [])[0]
    assert ex.prompt == rows[0]["prompt"] and env.reward_columns(ex) == {"answer": "x", "meta": {"k": [1, 2]}}
    with pytest.raises(ValueError, match="JSON values"):
        write_rows([{"prompt": "p", "x": object()}], tmp_path / "bad.jsonl")
    assert json.loads((tmp_path / "d" / "train.jsonl").read_text())["answer"] == "x"


def wait_for_code(c: InProcess, timeout: float = 10.0) -> int | None:
    deadline = time.monotonic() + timeout
    while c.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return c.poll()


def test_in_process_component_exit_codes_logs_and_stop(tmp_path):
    import logging

    async def ok() -> None:
        logging.getLogger("tidal.orch").info("batch 1 written")

    async def boom() -> None:
        raise RuntimeError("reward exploded")

    async def forever() -> None:
        await asyncio.sleep(3600)

    done = InProcess("orch", ok, tmp_path / "ok.log", echo=False)
    assert wait_for_code(done) == 0
    done.close()
    assert "[orch] batch 1 written" in (tmp_path / "ok.log").read_text()
    failed = InProcess("orch", boom, tmp_path / "boom.log", echo=False)
    assert wait_for_code(failed) == 1
    failed.close()
    assert "RuntimeError: reward exploded" in failed.tail()
    running = InProcess("orch", forever, tmp_path / "run.log", echo=False)
    time.sleep(0.2)
    assert running.poll() is None
    running.signal_group(signal.SIGTERM)
    assert running.proc.wait(timeout=5) == 143
    running.close()


def lookup(word: str) -> str:
    """Look a word up.

    Args:
        word: the word
    """
    return word.upper()


class Box:
    """An environment_factory environment that scores itself."""

    def reset(self, **row):
        self.opened = False

    def open_box(self) -> str:
        """Open the box."""
        self.opened = True
        return "opened"

    def get_reward(self) -> float:
        return float(self.opened)


def test_tools_and_environment_factory_make_the_run_tooling():
    t = make(tools=[lookup], environment_factory=Box, args=GRPOConfig(
        num_generations=2, per_device_train_batch_size=4, max_tool_calling_iterations=3))
    assert t.tooling.max_iterations == 3
    assert [s["function"]["name"] for s in t.tooling.schemas] == ["lookup", "open_box"]
    only_env = make(reward_funcs=None, environment_factory=Box)  # get_reward is the reward: TRL allows no funcs
    assert only_env.reward_funcs == [] and only_env.tooling.has_reward
    with pytest.raises(ValueError, match="reward_funcs is empty"):
        make(reward_funcs=None, tools=[lookup])
    with pytest.raises(ValueError, match="max_tool_calling_iterations needs tools"):
        make(args=GRPOConfig(num_generations=2, per_device_train_batch_size=4, max_tool_calling_iterations=1))
    with pytest.raises(ValueError, match="tool .*type hints"):
        make(tools=[lambda x: x])


def complete_checkpoint(run_dir, component, step):
    from tidal.paths import STABLE, ckpt_dir

    d = ckpt_dir(run_dir, component, step)
    d.mkdir(parents=True)
    (d / STABLE).write_text("")
    return d


def test_resume_from_checkpoint_true_a_path_or_nothing(tmp_path):
    from tidal.api.trainer import resume_step

    run = tmp_path / "run"
    assert resume_step(None, run) is None and resume_step(False, run) is None
    with pytest.raises(ValueError, match=r"resume_from_checkpoint=True: no complete checkpoint in .*run/checkpoints"):
        resume_step(True, run)  # as TRL: nothing to resume is an error, not a fresh start
    for step in (5, 10):
        complete_checkpoint(run, "trainer", step)
    orch5 = complete_checkpoint(run, "orch", 5)
    (run / "checkpoints" / "orch" / "step_10").mkdir()  # no STABLE: incomplete
    assert resume_step(True, run) == 5  # the newest step complete on both sides
    assert resume_step(str(orch5), run) == 5 and resume_step(run / "checkpoints" / "trainer" / "step_5", run) == 5
    for path in (run / "checkpoints" / "trainer" / "step_10", tmp_path / "other" / "checkpoints" / "trainer" / "step_5",
                 run / "checkpoint-500"):
        with pytest.raises(ValueError, match=r"is not a complete checkpoint of the run .* its checkpoints: "
                                             r".*trainer/step_5$"):
            resume_step(str(path), run)
    with pytest.raises(TypeError, match="must be a bool, a path or None"):
        resume_step(5, run)


@pytest.mark.parametrize("resume", [None, True, "path"])
def test_train_resume_from_checkpoint_reaches_both_components(tmp_path, monkeypatch, resume):
    """`trainer.train(resume_from_checkpoint=...)`, TRL's way to resume, becomes train and orch
    `ckpt.resume_step` of the run the launcher starts (and a resuming placement: the run is not moved aside)."""
    from tidal.colocate import start
    from tidal.paths import metrics_path

    run = tmp_path / "run"
    t = make(args=GRPOConfig(output_dir=str(run), num_generations=2, per_device_train_batch_size=4, save_steps=1))
    complete_checkpoint(run, "trainer", 2)
    complete_checkpoint(run, "orch", 2)
    started = []

    def fake_start(co, **kw):
        started.append(co)
        metrics_path(run).write_text(json.dumps({"step": 3, "loss": 0.5}) + "\n")
        return 0

    monkeypatch.setattr(start, "start", fake_start)
    arg = str(run / "checkpoints" / "orch" / "step_2") if resume == "path" else resume
    out = t.train(resume_from_checkpoint=arg)
    co = started[0]
    want = None if resume is None else 2
    assert co.train.ckpt.resume_step == co.orch.ckpt.resume_step == want
    assert co.placement.resuming is (want is not None) and out.global_step == 3


def test_train_refuses_a_resume_with_nothing_to_resume(tmp_path, monkeypatch):
    from tidal.colocate import start

    monkeypatch.setattr(start, "start", lambda co, **kw: pytest.fail("started"))
    t = make(args=GRPOConfig(output_dir=str(tmp_path / "run"), num_generations=2, per_device_train_batch_size=4))
    with pytest.raises(ValueError, match="no complete checkpoint"):
        t.train(resume_from_checkpoint=True)
    with pytest.raises(ValueError, match="is not a complete checkpoint of the run"):
        t.train(resume_from_checkpoint=str(tmp_path / "checkpoint-500"))
