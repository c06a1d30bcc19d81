"""The TRL side of `make bench-gpu-e2e` (bench/gpu_e2e.py), run in its own process (`gpu_e2e.py --trl-child SPEC`):
TRL 1.16's `GRPOTrainer` on the spec's model and workload (vLLM colocate on a GPU), with per-step times from TRL's
own profiling contexts (`vLLM.generate`, `sync_weights`, `_prepare_inputs`) and a step callback, written as json to
the spec's `out` for the parent to read.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""LoRA r16 targets of both sides: every linear layer of the decoder."""


def trl_child(spec_path: str) -> int:
    """The TRL side, in its own process: GRPOTrainer on the spec's model and workload; writes per-step times."""
    spec = json.loads(Path(spec_path).read_text())
    wl, cuda = spec["workload"], spec["cuda"]
    import random

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    from tidal.envs.reverse_text import ReverseText, extract_answer, similarity

    timings: dict[str, float] = {}
    original = profiling.ProfilingContext._log_metrics

    def record(self: Any, duration: float) -> None:  # TRL's own timers: name -> seconds within the current step
        timings[self.name.split(".", 1)[-1]] = timings.get(self.name.split(".", 1)[-1], 0.0) + duration
        original(self, duration)

    profiling.ProfilingContext._log_metrics = record
    env, rng = ReverseText(wl["text_chars"], wl["text_chars"]), random.Random(0)
    rows = [env.sample(rng) for _ in range(wl["prompts"] * (wl["warmup"] + wl["steps"] + 1))]
    data = Dataset.from_list([{"prompt": ex.prompt, "answer": ex.answer} for ex in rows])

    def reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        return [similarity(extract_answer(c[0]["content"]), a) for c, a in zip(completions, answer, strict=True)]

    steps: list[dict[str, Any]] = []
    step_logs: dict[int, dict[str, Any]] = {}
    mark: dict[str, float] = {}
    timer = step_timer(cuda, timings, steps, step_logs, mark)
    settings = dict(spec["settings"])
    cfg = GRPOConfig(**settings)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16 if cuda else torch.float32)
    tok = AutoTokenizer.from_pretrained(spec["model"])
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=LORA_TARGETS)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok,
                          peft_config=lora, callbacks=[timer])
    built = time.time()
    trainer.train()
    for s in steps:
        s["completions/mean_length"] = step_logs.get(s["step"], {}).get("completions/mean_length")
    Path(spec["out"]).write_text(json.dumps({"steps": steps, "built": built, "versions": package_versions(),
                                             "train_begin": mark.get("train_begin", built),
                                             "logs": {str(k): v for k, v in step_logs.items()}}, default=str))
    return 0


def package_versions() -> dict[str, str]:
    """The TRL side's package versions (vLLM where installed)."""
    import importlib.metadata as md

    versions = {n: md.version(n) for n in ("trl", "datasets", "transformers", "peft", "accelerate", "torch")}
    try:
        versions["vllm"] = md.version("vllm")
    except md.PackageNotFoundError:
        pass
    return versions


def step_timer(cuda: bool, timings: dict[str, float], steps: list[dict[str, Any]],
               step_logs: dict[int, dict[str, Any]], mark: dict[str, float]) -> Any:
    """A `TrainerCallback` that appends each step's begin, end and split (generation, weight sync, scoring, training
    from TRL's `timings` of the step) to `steps`, and TRL's logged rows to `step_logs`."""
    import torch
    from transformers import TrainerCallback

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    class Timer(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            mark["train_begin"] = time.time()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            sync()
            mark["begin"] = time.time()
            timings.clear()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            sync()
            end = time.time()
            gen = sum(v for k, v in timings.items() if "generate" in k)
            wsync = timings.get("sync_weights", 0.0)
            prep = timings.get("_prepare_inputs", gen + wsync)
            split = {"generation_s": gen, "weight_sync_s": wsync,
                     "scoring_and_old_logprobs_s": max(prep - gen - wsync, 0.0),
                     "training_s": max(end - mark["begin"] - prep, 0.0)}
            steps.append({"step": state.global_step, "begin": mark["begin"], "end": end, "split_s": split,
                          "timers": dict(timings)})

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs:  # the last step's row and the run's summary come with the same global_step
                step_logs.setdefault(state.global_step, {}).update(logs)

    return Timer()
