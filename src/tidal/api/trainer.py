"""The Python API for TRL users: `from tidal import GRPOConfig, GRPOTrainer`.

    trainer = GRPOTrainer(model="Qwen/Qwen3-0.6B", reward_funcs=[f, g], args=GRPOConfig(...),
                          train_dataset=dataset, eval_dataset=None, peft_config=LoraConfig(...))
    trainer.train()

runs the same pipeline as `tidal grpo`: a vLLM server and the trainer as supervised subprocesses (the co-locate
launcher, `tidal.colocate.supervise.run_colocate`, with the placement of `tidal.colocate.derive.derive_colocate`), and
the orchestrator in THIS process, on its own asyncio loop in a thread, so reward functions defined in the script
(closures and lambdas included) are called where they live; nothing is pickled. `args` maps onto tidal's configs
by `tidal.api.grpo_config.to_tidal` (docs/trl.md). The datasets are written to `{output_dir}/data/*.jsonl`
(`tidal.paths.data_dir`) and read by the `dataset` environment (`tidal.envs.dataset`): a string `prompt` is a
standard prompt (no chat template), a list of messages a conversational one; every other column reaches the reward
functions. The resolved configs land in `{output_dir}/configs/` as with `tidal grpo`.
`train(resume_from_checkpoint=True | path)` resumes the run from its checkpoints, as `tidal grpo --resume` does.

Differences from TRL (docs/trl.md): without `peft_config` every weight trains, as in TRL; `model` must be a name
or path, not a loaded model;
`tools` and `environment_factory` run in the model's chat format (`tidal.envs.tools`, `tidal.orchestrator.toolloop`;
tool calls parsed in the Hermes, Mistral or Llama-3 JSON format, whichever the model writes; one factory, not a
dict of them); `reward_funcs` may be left out when the environments score themselves (`get_reward`). A string in
`reward_funcs` is an import path
(`package.module:function`) or a reward model (`tidal.rewards.model.RewardModel`: a sequence-classification
model, loaded once in this process). `processing_class`, `optimizers` (a class and kwargs) and `rollout_func`
(TRL's custom-rollout hook, sampling through tidal's vLLM server: `tidal.orchestrator.rollout_func`) are
`tidal.api.args`; `callbacks` (transformers TrainerCallbacks, fed from the run's metrics) `tidal.api.callbacks`.
`agent` (tidal's own: a user's agent program trained unchanged through the per-session OpenAI / Anthropic endpoint,
docs/agents.md) is `tidal.api.agent`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.api.grpo_config import GRPOConfig, to_tidal
from tidal.checkpoint import complete_steps
from tidal.config.load import ConfigError
from tidal.config.orch import OrchConfig
from tidal.paths import ckpt_dir, ckpt_root, data_dir, final_dir, logs_dir, metrics_path
from tidal.procs import EXPORT_FAILED

log = logging.getLogger("tidal.api")


class RefusedConfig(ConfigError, ValueError):
    """A run tidal refuses before anything starts (`tidal.colocate.preflight`): a `ConfigError` (as `tidal grpo` exits 2
    with) and a `ValueError` (as TRL raises for bad arguments); the message names the key and the fix."""


@dataclass
class TrainOutput:
    """What `train()` returns (TRL returns a TrainOutput too)."""

    global_step: int
    """Training steps done (tidal batches; each holds `optimizer_steps_per_batch` optimizer steps)."""
    run_dir: Path
    """The run directory: metrics.jsonl, broadcasts/, checkpoints/, logs/."""
    metrics: dict[str, float]
    """The last step's metrics row."""


def as_rows(dataset: Any, what: str) -> list[dict[str, Any]]:
    """The rows of a `datasets.Dataset` (or a list of dicts); errors name `what`."""
    if isinstance(dataset, list):
        rows = dataset
    elif hasattr(dataset, "column_names") and hasattr(dataset, "__len__"):
        rows = [dict(r) for r in dataset]
    else:
        raise TypeError(f"{what} must be a datasets.Dataset or a list of dicts, got {type(dataset).__name__} (an "
                        f"IterableDataset or DatasetDict: pick a split / materialize it)")
    if not rows or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{what} must hold at least one row, each a dict")
    if "prompt" not in rows[0]:
        raise ValueError(f"{what} has no 'prompt' column (columns: {', '.join(rows[0])})")
    return rows


def eval_sets(eval_dataset: Any) -> dict[str, list[dict[str, Any]]]:
    """The eval datasets by name: one dataset is `eval` (metrics `eval/eval/...`); a dict of datasets (TRL) keeps
    its keys (`eval/{key}/...`)."""
    if eval_dataset is None:
        return {}
    if isinstance(eval_dataset, dict) and not hasattr(eval_dataset, "column_names"):
        bad = [k for k in eval_dataset if not str(k).replace("_", "").replace("-", "").isalnum() or k == "train"]
        if bad:
            raise ValueError(f"eval_dataset key {bad[0]!r}: use letters, digits, '_' or '-' (and not 'train')")
        return {str(k): as_rows(v, f"eval_dataset[{k!r}]") for k, v in eval_dataset.items()}
    return {"eval": as_rows(eval_dataset, "eval_dataset")}


def write_rows(rows: list[dict[str, Any]], path: Path) -> None:
    """Rows as JSON lines (`datasets` reads them back with the same columns); non-JSON values are refused."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    except TypeError as exc:
        raise ValueError(f"dataset rows must hold JSON values (strings, numbers, lists, dicts) to reach the "
                         f"orchestrator's dataset environment: {exc}") from None
    path.write_text(text)


def reward_functions(reward_funcs: Any, weights: Sequence[float] | None) -> list[tuple[str, Callable[..., Any], float]]:
    """(unique name, function, weight) of each reward function; a string is an import path (`pkg.mod:fn`) or
    else a reward model (a sequence-classification model's name or directory, `tidal.rewards.model`)."""
    from tidal.orchestrator.advantage import load_function
    from tidal.rewards.model import RewardModel

    funcs = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [
        reward_funcs]
    if not funcs:
        raise ValueError("reward_funcs is empty: give at least one reward function (or an environment_factory whose "
                         "environment has get_reward)")
    if weights is not None and len(weights) != len(funcs):
        raise ValueError(f"GRPOConfig reward_weights has {len(weights)} weights for {len(funcs)} reward functions")
    out: list[tuple[str, Callable[..., Any], float]] = []
    for i, f in enumerate(funcs):
        if isinstance(f, str):
            f = load_function(f) if ":" in f and not f.startswith("tidal:") else RewardModel(f)
        if not callable(f):
            raise TypeError(f"reward_funcs[{i}] is a {type(f).__name__}, not a function")
        name = str(getattr(f, "__name__", f"reward_{i}"))
        taken = {n for n, _, _ in out}
        if name in taken:
            name = next(f"{name}_{k}" for k in range(2, len(funcs) + 2) if f"{name}_{k}" not in taken)
        out.append((name, f, 1.0 if weights is None else float(weights[i])))
    return out


def resume_step(resume_from_checkpoint: bool | str | Path | None, run_dir: Path) -> int | None:
    """TRL's `train(resume_from_checkpoint=...)` -> the step tidal resumes (train/orch `ckpt.resume_step`), or None
    for a fresh run. True: the newest step whose trainer and orchestrator checkpoints are both complete (TRL raises
    ValueError without one; so does this); a path: `{run_dir}/checkpoints/{trainer|orch}/step_N` of this run, complete
    on both sides (ValueError for any other path)."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    steps = sorted(set(complete_steps(run_dir, "trainer")) & set(complete_steps(run_dir, "orch")))
    have = ", ".join(str(ckpt_dir(run_dir, "trainer", s)) for s in steps) or "none"
    if resume_from_checkpoint is True:
        if not steps:
            raise ValueError(f"resume_from_checkpoint=True: no complete checkpoint in {run_dir / 'checkpoints'} (the "
                             f"run in GRPOConfig output_dir {run_dir}; checkpoints are written every save_steps)")
        return steps[-1]
    if not isinstance(resume_from_checkpoint, str | Path):
        raise TypeError(f"resume_from_checkpoint must be a bool, a path or None, got "
                        f"{type(resume_from_checkpoint).__name__}")
    path = Path(resume_from_checkpoint).resolve()
    for component in ("trainer", "orch"):
        name = path.name.removeprefix("step_")
        if path.parent == ckpt_root(run_dir, component).resolve() and name.isdigit() and int(name) in steps:
            return int(name)
    raise ValueError(f"resume_from_checkpoint={str(resume_from_checkpoint)!r} is not a complete checkpoint of the run "
                     f"in GRPOConfig output_dir {run_dir} (tidal resumes a run from its own checkpoints, trainer and "
                     f"orchestrator of one step); its checkpoints: {have}")


def make_tooling(tools: Any, environment_factory: Any, max_iterations: int | None) -> Any:
    """The run's `tidal.envs.tools.Tooling` from TRL's `tools` (functions) and `environment_factory`, or None."""
    from tidal.envs.tools import Tooling

    if tools is None and environment_factory is None:
        if max_iterations is not None:
            raise ValueError("GRPOConfig max_tool_calling_iterations needs tools or an environment_factory")
        return None
    if environment_factory is not None and isinstance(environment_factory, dict):
        raise NotImplementedError("GRPOTrainer(environment_factory={name: factory}) (several environments) is not "
                                  "supported by tidal yet; give one factory")
    funcs = list(tools) if isinstance(tools, list | tuple) else [] if tools is None else [tools]
    return Tooling(funcs, environment_factory, "auto", max_iterations)


class GRPOTrainer:
    """TRL's GRPOTrainer signature, running tidal's pipeline (see the module docs)."""

    def __init__(self, model: str, reward_funcs: Any = None, args: GRPOConfig | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: Any = None, optimizers: Any = (None, None), peft_config: Any = None, tools: Any = None,
                 environment_factory: Any = None, rollout_func: Any = None, quantization_config: Any = None,
                 agent: Any = None) -> None:
        from tidal.api import args as api_args  # TRL's other arguments: used, or refused with the reason
        from tidal.api.agent import agent_args

        api_args.refuse_unsupported(quantization_config=quantization_config)
        if not isinstance(model, str | Path):
            raise TypeError(f"model must be a model name or directory (tidal's vLLM server and trainer load it "
                            f"themselves), got a {type(model).__name__}; pass its path")
        if train_dataset is None:
            raise ValueError("train_dataset is required")
        self.model = str(model)
        self.args = api_args.with_optimizer(args if args is not None else GRPOConfig(), optimizers)
        api_args.check_processing_class(processing_class, self.model, self.args.chat_template_path)
        self.processing_class = processing_class
        self.train_rows = as_rows(train_dataset, "train_dataset")
        self.eval_sets = eval_sets(eval_dataset)
        if agent is not None and (tools is not None or environment_factory is not None or rollout_func is not None):
            raise ValueError("GRPOTrainer(agent=...) runs your own agent program, which owns its loop and tools; "
                             "drop tools / environment_factory / rollout_func (or agent)")
        self.tooling = make_tooling(tools, environment_factory, self.args.max_tool_calling_iterations)
        no_funcs = reward_funcs in (None, [])
        self.agent = agent_args(agent, not no_funcs)
        """The `agent` environment's args (`tidal.api.agent`), or None."""
        self.reward_funcs = ([] if no_funcs and (self.tooling is not None and self.tooling.has_reward
                                                 or self.agent is not None)
                             else reward_functions(reward_funcs, self.args.reward_weights))
        api_args.check_reward_processing_classes(reward_processing_classes, self.reward_funcs)
        self.rollout_func = api_args.rollout_function(rollout_func, self.model, self.args, processing_class,
                                                      self.tooling)
        self.derived = to_tidal(self.args, self.model, len(self.train_rows), len(self.reward_funcs), peft_config,
                                eval_names=list(self.eval_sets))
        self.run_dir = Path(self.args.output_dir)
        self.colocated = self.preflight()
        if self.args.use_cpu and self.colocated.placement.device != "cpu":
            raise RefusedConfig(f"GRPOConfig use_cpu=True, but this machine has a {self.colocated.placement.device} "
                                f"device, which tidal places the run on; hide it (CUDA_VISIBLE_DEVICES='') to train "
                                f"on the CPU")
        self.callbacks = None
        if callbacks:  # TRL's TrainerCallbacks, fed from the run's metrics and checkpoints (tidal.api.callbacks)
            from tidal.api.callbacks import RunCallbacks

            self.callbacks = RunCallbacks(list(callbacks), self.args, processing_class,
                                          self.derived.orch.max_steps or 0)

    def preflight(self) -> Any:
        """The configs `tidal grpo` would derive on this machine, after every check it runs before anything starts
        (`tidal.colocate.preflight`, the datasets in a scratch directory); raises `RefusedConfig` (a ValueError)."""
        import tempfile

        from tidal.colocate.preflight import check_run
        from tidal.models.arch import check_model

        try:
            check_model(self.model, "GRPOTrainer(model=...)")
            co = self.derive(calibrate=False)
            with tempfile.TemporaryDirectory(prefix="tidal-preflight-") as scratch:
                check_run(co.train, co.infer, self.with_data(co.orch, Path(scratch)), self.reward_funcs, self.tooling)
        except ConfigError as exc:
            raise RefusedConfig(str(exc)) from None
        return co

    def derive(self, calibrate: bool, resume: int | None = None) -> Any:
        """`derive_colocate` on this machine; `calibrate`: the GPU split measures the trainer's peak (one training
        step on the GPU) instead of trusting the estimate alone; `resume`: the checkpoint step the run resumes
        (train/orch `ckpt.resume_step`; None: a fresh run)."""
        from tidal.colocate import start

        d = self.derived
        train, orch = d.train, d.orch
        if resume is not None:
            train = train.model_copy(deep=True, update={"ckpt": train.ckpt.model_copy(update={"resume_step": resume})})
            orch = orch.model_copy(deep=True, update={"ckpt": orch.ckpt.model_copy(update={"resume_step": resume})})
        try:
            return start.derive(train, d.infer, orch, calibrate=calibrate)
        except ConfigError as exc:
            raise RefusedConfig(str(exc)) from None

    def with_data(self, orch: Any, data: Path) -> Any:
        """A copy of `orch` whose dataset environments read the train / eval rows, written under `data`."""
        write_rows(self.train_rows, data / "train.jsonl")
        orch = orch.model_copy(deep=True)
        orch.env[0].args = {"path": str((data / "train.jsonl").resolve())}
        if self.agent is not None:  # the rows are the examples an agent program gets (`tidal.api.agent`)
            orch.env[0] = self.agent_env(orch.env[0])
        if orch.eval is not None:
            for i, section in enumerate(orch.eval.env):  # one per eval dataset, named as given
                path = data / f"{section.name}.jsonl"
                write_rows(self.eval_sets[str(section.name)], path)
                section.args = {"path": str(path.resolve())}
                if self.agent is not None:  # evaluated through the agent program too
                    orch.eval.env[i] = self.agent_env(section)
        return orch

    def agent_env(self, dataset: Any) -> Any:
        """The `agent` environment whose examples are those of the `dataset` environment section `dataset`."""
        from tidal.config.environments import EnvSection

        return EnvSection(id="agent", name=dataset.name,
                          args={**(self.agent or {}), "task": {"id": "dataset", "args": dataset.args}})

    def train(self, resume_from_checkpoint: bool | str | None = None) -> TrainOutput:
        """Run GRPO to the end; raises RuntimeError naming the failed component and its log.
        `resume_from_checkpoint` (TRL's): True continues the run in `output_dir` from its newest checkpoint, a path
        from that checkpoint of this run (`resume_step`); None or False starts afresh."""
        from tidal.colocate import start
        from tidal.monitor.metrics import read_metrics
        from tidal.orchestrator import loop

        step = resume_step(resume_from_checkpoint, self.run_dir)
        co = self.colocated  # derived and checked by the constructor (`preflight`)
        gpu = co.placement.device == "cuda"
        if gpu or step is not None:  # on a GPU the split may now measure the trainer (one step, before vLLM)
            co = self.derive(calibrate=gpu, resume=step)
        run_dir = co.placement.run_dir
        reward_funcs = json.dumps([{"name": n, "weight": w} for n, _, w in self.reward_funcs], indent=1)

        cbs = self.callbacks
        stop = cbs.stop if cbs is not None else None

        async def orchestrate(orch: OrchConfig, run_dir: Path) -> None:
            await loop.run(orch, run_dir, self.reward_funcs, self.tooling, stop=stop, rollout_func=self.rollout_func)

        def saved() -> list[int]:
            return complete_steps(run_dir, "trainer")

        if cbs is not None:
            cbs.begin(metrics_path(run_dir), saved)
        try:
            code = start.start(co, infer_start_timeout_s=self.args.vllm_server_timeout,
                               orch_for=lambda orch, run_dir: self.with_data(orch, data_dir(run_dir)),
                               orchestrator=orchestrate, extra_configs={"reward_funcs.json": reward_funcs})
        except ConfigError as exc:
            raise RefusedConfig(str(exc)) from None
        finally:
            if cbs is not None:
                cbs.end(metrics_path(run_dir), saved)
        if code == 130:
            raise KeyboardInterrupt
        if code == EXPORT_FAILED:
            raise RuntimeError(f"tidal GRPO run trained to its end, but a final export it was asked for (export.gguf) "
                               f"failed; the trainer's log in {logs_dir(run_dir)} names the `tidal export` command "
                               f"that writes it")
        if code != 0:
            raise RuntimeError(f"tidal GRPO run failed (exit code {code}); logs in {logs_dir(run_dir)}")
        rows = read_metrics(metrics_path(run_dir))
        last = rows[-1] if rows else {}
        return TrainOutput(int(last.get("step", 0)), run_dir,
                           {k: float(v) for k, v in last.items() if isinstance(v, int | float)})

    def save_model(self, output_dir: str | None = None) -> Path:
        """Copy the trained LoRA adapter (`{run_dir}/final/adapter/`, a PEFT adapter directory) to `output_dir`
        (None: it stays where it is); returns where it is."""
        import shutil

        src = final_dir(self.run_dir, "adapter")
        if not (src / "adapter_config.json").is_file():
            raise RuntimeError(f"no trained adapter in {src}: call train() first")
        if output_dir is None or Path(output_dir).resolve() in (self.run_dir.resolve(), src.resolve()):
            return src
        shutil.copytree(src, output_dir, dirs_exist_ok=True)
        return Path(output_dir)


__all__ = ["ConfigError", "GRPOConfig", "GRPOTrainer", "RefusedConfig", "TrainOutput"]
