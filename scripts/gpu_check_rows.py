"""Rows of `make gpu-check` (scripts/gpu_check.py) for real-size models, refusals and failures, and the `--long`
rows for what docs/gpu.md still lists as unverified (issue 42). Kept apart from gpu_check.py; both stand on
scripts/gpu_check_base.py (`CheckFailed`, `grpo`, `judge_run`, `gpu_pids`, `wait_gone`, ...).

- g4: a Qwen3-4B-shaped random model (its real config, the bundled tokenizer) through `tidal grpo`: LoRA,
  on-policy (`max_async_level 0`, mismatch_kl <= 1e-3 at every step), then `max_async_level 1` judged at step 1;
  like g, it fails when the memory split tidal planned is below the whole GPU's peak NVML saw (all processes,
  above the use before) or more than `SPLIT_OVER_MAX` times it (`split_problem`);
- s: an oversized request (the 0.6B shape at 32k context x 128 rollouts, ~448 GiB of KV cache) exits 2 before
  anything starts, naming the keys; no process appears on the GPU, no run directory is written;
- o: a forced trainer out-of-memory error for real: a hand-set `gpu_memory_utilization 0.9` (no split) and a
  micro-batch far too big (every packed row at once, checkpointing off, unchunked logits): exit 1, the trainer's
  one line, nothing of the run left on the GPU (R6);
- `--long` only: L1 a co-located teacher (on-policy distillation: its vLLM beside the policy's and the trainer),
  L2 full fine-tuning against CUDA vLLM (the bundled model's tied head reloaded: on-policy at every step), L3 QLoRA
  NF4 (bitsandbytes), L4 `recipe: fp8-hybrid` (FP8 matmuls). SGLang is check j (any mode; skipped without its kit).

Each row keeps to its own budget (`run_checks` cuts it to what the run has left) and raises the harness's
`CheckFailed`; `run_checks` goes on past it.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_check_base as base  # noqa: E402 - what every row stands on: CheckFailed, grpo, judge_run, gpu_pids, ...


def e2e() -> Any:
    """bench/gpu_e2e.py: the real-shape model builder, one in the project."""
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_e2e

    return gpu_e2e


def peak_memory(cuda: bool) -> Any:
    """bench/gpu_memory.py's whole-GPU peak sampler (NVML, every process), started."""
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_memory

    return gpu_memory.PeakMemory(cuda=cuda)


SPLIT = re.compile(r"GPU \(([\d.]+) GiB\): vLLM ([\d.]+) GiB.*?trainer needs ([\d.]+) of the ([\d.]+) GiB left")


def planned_split(text: str) -> dict[str, Any]:
    """The split tidal printed (`tidal.colocate.split.GpuSplit.notice`), as figures: vLLM's and the trainer's GiB."""
    m = SPLIT.search(text)
    if not m:
        return {"planned": "no split notice"}
    total, vllm, trainer = float(m[1]), float(m[2]), float(m[3])
    return {"planned GiB (vLLM + trainer of total)": f"{vllm} + {trainer} = {vllm + trainer:.1f} of {total}"}


def planned_gib(text: str) -> float | None:
    """vLLM's plus the trainer's GiB of the split tidal printed; None without a split notice."""
    m = SPLIT.search(text)
    return None if m is None else float(m[2]) + float(m[3])


SPLIT_OVER_MAX = 1.25
"""A plan may exceed the measured peak by at most this factor: its fixed reserves (CUDA contexts, vLLM's graphs and
profiling, the trainer's headroom over its calibrated peak) are a few GiB, about a fifth of the 0.6B and 4B plans;
more than that is memory the split keeps from vLLM's KV cache for nothing."""


def split_problem(figs: dict[str, Any]) -> str | None:
    """Rows g and g4: why the planned split (`planned GiB`) does not match the whole GPU's peak the run added
    (NVML peak minus the use before): below it (the plan under-counts: an OOM waiting for a bigger batch) or above
    `SPLIT_OVER_MAX` times it. None when it holds."""
    planned = figs.get("planned GiB")
    peak, before = figs.get("NVML peak GiB (all processes)"), figs.get("NVML before GiB")
    if planned is None:
        return "no split notice in the run's output: the plan cannot be compared with NVML's peak"
    if peak is None or before is None or peak != peak or before != before:
        return "no NVML peak measured"
    used = peak - before
    if planned < used:
        return f"planned {planned:.1f} GiB < NVML's peak {used:.1f} GiB (above the {before:.1f} GiB before)"
    if planned > SPLIT_OVER_MAX * used:
        return f"planned {planned:.1f} GiB > {SPLIT_OVER_MAX}x NVML's peak {used:.1f} GiB"
    return None


def measured_grpo(ctx: Any, run_dir: Path, budget: float, log: Path, *args: str) -> tuple[int, str, dict[str, Any]]:
    """`tidal grpo` (the harness's `grpo`) with the whole GPU's used memory sampled meanwhile (NVML, every process):
    (exit code, output, figures: the split planned against the peak seen, above the GPU's use before)."""
    mem = peak_memory(not ctx.cpu)
    try:
        code, text = base.grpo(ctx, run_dir, budget, log, *args)
    finally:
        peak = mem.stop()
    figs: dict[str, Any] = {**planned_split(text), "planned GiB": planned_gib(text)}
    figs["NVML peak GiB (all processes)"] = round(peak, 1)
    figs["NVML before GiB"] = round(mem.base_gib, 1)
    return code, text, figs


def qwen3_4b(ctx: Any) -> Path:
    """The Qwen3-4B shape (bench/gpu_e2e.py's config: Qwen/Qwen3-4B's), random init in bf16, built on the GPU in a
    child process, with the bundled tokenizer (128 ids: they fit any vocabulary)."""
    return e2e().build_model("4b", ctx.work / "qwen3-4b-random", None, not ctx.cpu)


def check_4b(ctx: Any, res: Any) -> None:
    """The 4B shape through `tidal grpo`: LoRA on-policy (every step judged), then async 1 (step 1 judged)."""
    budget, started = res.figures.pop("_budget"), time.monotonic()
    model = qwen3_4b(ctx)
    res.figures["model built s"] = round(time.monotonic() - started, 1)
    for mode, steps, extra, judged in (("on-policy", 4, ["--orch.max_async_level", "0"], None),
                                       ("async 1", 3, ["--orch.max_async_level", "1"], 1)):
        sub = base.Result(mode, mode)
        before = base.gpu_pids()
        run_dir = ctx.work / f"g4_{mode.replace(' ', '_')}"
        code, text, figs = measured_grpo(ctx, run_dir, budget - (time.monotonic() - started),
                                         ctx.work / f"g4_{mode.replace(' ', '_')}.log", "--model", str(model),
                                         "--orch.max_steps", str(steps), *extra)
        sub.figures.update(figs)
        try:
            rows = base.judge_run(sub, code, text, run_dir, steps, on_policy_steps=judged)
            sub.figures["mismatch_kl per step"] = [float(f"{r['mismatch_kl']:.2g}") for r in rows]
            if problem := split_problem(figs):
                raise base.CheckFailed(f"{mode}: {problem}")
        finally:
            res.figures[mode] = sub.figures
            res.log_tail = sub.log_tail
        if left := base.wait_gone(before):
            raise base.CheckFailed(f"{mode}: processes left on the GPU: {sorted(left)}")


def check_oversized(ctx: Any, res: Any) -> None:
    """An oversized request exits 2 before anything starts: the 0.6B shape (g's) at 32k context x 128 rollouts."""
    model = base.qwen3_0_6b(ctx)
    before = base.gpu_pids()
    run_dir = ctx.work / "s_run"
    started = time.monotonic()
    code, text = base.grpo(ctx, run_dir, res.figures.pop("_budget"), ctx.work / "s_grpo.log", "--model", str(model),
                        "--orch.batch_size", "128", "--orch.rollouts_per_example", "16", "--orch.seq_len", "32768",
                        "--train.sequence_len", "32768", "--infer.max_model_len", "32768")
    res.figures["exit"], res.figures["seconds to refuse"] = code, round(time.monotonic() - started, 1)
    res.log_tail = base.tail(text, 8)
    line = next((ln for ln in text.splitlines() if "do not both fit" in ln), "")
    res.figures["message"] = line.strip()[:400]
    if code != 2:
        raise base.CheckFailed(f"tidal grpo exited with {code}, not 2")
    missing = [k for k in ("orch seq_len", "orch batch_size", "per_device_train_batch_size") if k not in line]
    if not line or missing:
        raise base.CheckFailed(f"the refusal does not name the keys {missing or 'at all'}")
    if started_any := base.gpu_pids() - before:
        raise base.CheckFailed(f"processes on the GPU after the refusal: {sorted(started_any)}")
    if (run_dir / "logs").exists():
        raise base.CheckFailed("the run directory got logs: something started")


def check_trainer_oom(ctx: Any, res: Any) -> None:
    """A real CUDA out-of-memory error in the trainer (R6): exit 1, its one line, nothing of the run left."""
    model = base.qwen3_0_6b(ctx)
    before = base.gpu_pids()
    run_dir = ctx.work / "o_run"
    code, text, figs = measured_grpo(ctx, run_dir, res.figures.pop("_budget"), ctx.work / "o_grpo.log",
                                     "--model", str(model), "--orch.max_steps", "2",
                                     "--infer.gpu_memory_utilization", "0.9", "--train.gradient_checkpointing",
                                     "false", "--train.per_device_train_batch_size", "64",
                                     "--train.logprob_chunk_size", "0")
    res.figures.update(figs)
    res.figures["exit"] = code
    res.log_tail = base.tail(text)
    lines = [ln for ln in text.splitlines() if "CUDA out of memory in the trainer" in ln]
    res.figures["message"] = lines[0].strip()[:400] if lines else None
    left = base.wait_gone(before)
    res.figures["left after 60 s"] = sorted(left)
    if code != 1:
        raise base.CheckFailed(f"tidal grpo exited with {code}, not 1")
    if not lines or "Traceback" in text.split(lines[0])[0][-2000:]:
        raise base.CheckFailed("no one-line out-of-memory message from the trainer (or a traceback before it)")
    if left:
        raise base.CheckFailed(f"processes of the run left on the GPU: {sorted(left)}")


def long_run(ctx: Any, res: Any, name: str, steps: int, *args: str, on_policy_steps: int | None = 1,
             judge_kl: bool = True) -> None:
    """A `--long` row: the bundled `tidal grpo` with `args`, split vs NVML peak, nothing left after it."""
    if not ctx.long:
        res.status, res.detail = "skipped", "--long only"
        return
    before = base.gpu_pids()
    run_dir = ctx.work / name
    code, text, figs = measured_grpo(ctx, run_dir, res.figures.pop("_budget"), ctx.work / f"{name}.log",
                                     "--orch.max_steps", str(steps), *args)
    res.figures.update(figs)
    rows = base.judge_run(res, code, text, run_dir, steps, on_policy_steps=on_policy_steps if judge_kl else 0)
    res.figures["mismatch_kl per step"] = [r.get("mismatch_kl") for r in rows]
    if left := base.wait_gone(before):
        raise base.CheckFailed(f"processes left on the GPU: {sorted(left)}")


def check_teacher(ctx: Any, res: Any) -> None:
    """On-policy distillation with a teacher server tidal starts on the same GPU (its reserve, two vLLMs)."""
    long_run(ctx, res, "L1_teacher", 3, "--orch.teacher.model", "tidal:tiny-reverse", "--orch.advantage.type", "none",
             "--train.loss.teacher_tau", "1")


def check_full_finetune(ctx: Any, res: Any) -> None:
    """Full fine-tuning against CUDA vLLM, on-policy at every step: merged reloads refresh the tied head."""
    long_run(ctx, res, "L2_full", 4, "--train.lora", "false", "--orch.max_async_level", "0", on_policy_steps=None)


def check_qlora_nf4(ctx: Any, res: Any) -> None:
    """QLoRA with an NF4 base (bitsandbytes): vLLM serves the dequantized base, LoRA adapters on top."""
    long_run(ctx, res, "L3_nf4", 3, "--train.qlora_bnb", "true")


def check_fp8_hybrid(ctx: Any, res: Any) -> None:
    """`recipe: fp8-hybrid`: the base model's matmuls in FP8 (mismatch_kl recorded, not judged: FP8 rounding)."""
    long_run(ctx, res, "L4_fp8", 3, "--train.recipe", "fp8-hybrid", judge_kl=False)
