"""Regenerate the golden trajectory data of `tests/unit/test_golden_trajectory.py` (`tests/data/golden/`).

Three modes (any may be combined; `--batches` runs first, `--spread` last):

`--batches`: run one short real co-locate `tidal grpo` on the bundled model (vLLM on CPU, about a minute on 2
cores) with the bundled reverse-text example and these overrides:

    tidal grpo --orch.max_steps 3 --orch.batch_size 16 --orch.rollouts_per_example 8 \\
               --infer.port <free port> --output-dir <temporary directory>

and copy the orchestrator's `rollouts/step_{1,2,3}.safetensors` (2 prompts x 8 rollouts each, ~17 KB) into
`tests/data/golden/`. The command and the losses and grad norms the run's own trainer logged are kept in
`expected.json` (`source_run`): the `aipo` trajectory is that trainer's configuration, so `--record`
reproduces them up to float32 rounding (that run trained in float32 with the CPU's native kernels, the test runs
float64: up to ~2e-5 relative, printed by `--record`).
Sampling is not seeded, so every `--batches` gives new batches; run `--record` after it.

`--record`: recompute the expected numbers: every trajectory of the test, by the test's own code (a child
process with torch and MKL pinned to AVX2 kernels, one thread, deterministic algorithms, the policy cast to
float64 after loading; needs an x86-64 CPU with AVX2) on the committed batches, written to `expected.json` as repr
floats with the batches' sha256, the configs, the dtype and the torch/transformers/peft versions used.

`--spread`: measure what the test's tolerance is based on: every trajectory (the perturbed one too) in the
child as the test runs it, then again under other kernel paths (`SPREAD_VARIANTS`: torch's AVX-512 kernels,
MKL's other code paths, 2 and 4 threads, nothing pinned; torch's DEFAULT kernels last, reported apart: they
draw another LoRA init), and print each variant's largest relative difference from the pinned run and the
margin RTOL and ATOL leave. `--spread --dtype float32` measures the float32 trainer the same way (for comparison;
about 2 minutes either way on 2 cores). Changes nothing.

Re-record ONLY when a numeric change of the trainer is intended (and say why in the commit): the golden test
exists to catch the unintended ones.

Run: `.venv/bin/python scripts/make_golden.py --record` (a few seconds), or `--batches --record` (about a minute),
or `--spread`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

golden: Any = importlib.import_module("tests.unit.test_golden_trajectory")  # the test that reads what this writes

sys.path.insert(0, str(REPO / "scripts"))
import harness  # noqa: E402 - the benches' and checks' one harness (tidal.procs)
from harness import free_port  # noqa: E402

SPREAD_VARIANTS: list[dict[str, str | None]] = [
    {"ATEN_CPU_CAPABILITY": "avx512"},
    {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"},
    {"ATEN_CPU_CAPABILITY": "avx512", "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"},
    {"MKL_CBWR": "AUTO"}, {"MKL_CBWR": "AVX512"}, {"MKL_CBWR": "COMPATIBLE"}, {"MKL_CBWR": "SSE4_2"},
    {"ATEN_CPU_CAPABILITY": None, "MKL_CBWR": None, "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"},
    {"ATEN_CPU_CAPABILITY": None, "MKL_CBWR": None, "OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4"},
    {"ATEN_CPU_CAPABILITY": "default"},  # last: another LoRA init (the test skips on such CPUs)
]
"""Kernel paths `--spread` compares with the pinned child (changes to PINNED_ENV; None unsets a variable)."""

OVERRIDES = ["--orch.max_steps", "3", "--orch.batch_size", "16", "--orch.rollouts_per_example", "8",
             "--orch.sampling.max_tokens", "24"]  # short enough that some completions are truncated


def load_expected() -> dict[str, Any]:
    return json.loads(golden.EXPECTED.read_text()) if golden.EXPECTED.exists() else {}


def write_expected(data: dict[str, Any]) -> None:
    golden.GOLDEN.mkdir(parents=True, exist_ok=True)
    golden.EXPECTED.write_text(json.dumps(data, indent=1) + "\n")


def make_batches() -> None:
    """One real co-locate run; copy its first three batches and note what its trainer logged."""
    with tempfile.TemporaryDirectory(prefix="tidal-golden-") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = ["tidal", "grpo", *OVERRIDES, "--infer.port", str(free_port()), "--output-dir", str(run_dir)]
        log = Path(tmp) / "grpo.log"
        print("running:", " ".join(cmd), flush=True)
        env = os.environ | {"TIDAL_PLAIN": "1", "HF_HUB_OFFLINE": "1"}
        rc, _ = harness.run([sys.executable, "-m", "tidal.cli", *cmd[1:]], log, 900, env=env, name="grpo")
        if rc != 0:
            sys.exit(f"tidal grpo failed with exit code {rc}:\n{log.read_text()[-3000:]}")
        golden.GOLDEN.mkdir(parents=True, exist_ok=True)
        for path in golden.batch_paths():
            shutil.copyfile(run_dir / "rollouts" / path.name, path)
            print(f"wrote {path.relative_to(REPO)} ({path.stat().st_size:,} bytes)")
        logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        trainer = [{"step": m["step"], "loss": m["loss"], "grad_norm": m["grad_norm"]} for m in logged
                   if m.get("step") in golden.STEPS and "loss" in m]
    data = load_expected()
    data["source_run"] = {"command": " ".join(cmd[:-4] + ["--infer.port", "<free port>", "--output-dir", "<tmp>"]),
                          "trainer_metrics": trainer}
    data.pop("trajectories", None)  # stale until --record
    write_expected(data)
    print("batches replaced: now run `scripts/make_golden.py --record`")


def record() -> None:
    data = load_expected()
    data["about"] = ("Expected numbers of tests/unit/test_golden_trajectory.py; regenerate ONLY for an intended "
                     "numeric change: .venv/bin/python scripts/make_golden.py --record")
    result = golden.compute_pinned(list(golden.TRAJECTORIES))
    if result["capability"] != "AVX2":
        sys.exit(f"recording needs an x86-64 CPU with AVX2 (torch's kernels here: {result['capability']})")
    data["recorded_with"] = result["versions"] | {"dtype": result["dtype"], "threads": result["threads"],
                                                  "env": golden.PINNED_ENV}
    data["batches"] = {p.name: golden.sha256(p) for p in golden.batch_paths()}
    data["trajectories"] = {name: {"config": config, "steps": result["results"][name]}
                            for name, config in golden.TRAJECTORIES.items()}
    for name, traj in data["trajectories"].items():
        for n, m in enumerate(traj["steps"], start=1):
            print(f"{name} step {n}: " + ", ".join(f"{k} {v!r}" for k, v in m.items()))
    for logged in data.get("source_run", {}).get("trainer_metrics", []):
        ours = data["trajectories"]["aipo"]["steps"][logged["step"] - 1]
        rel = {k: abs(ours[k] - logged[k]) / abs(logged[k]) for k in ("loss", "grad_norm")}
        print(f"source run step {logged['step']}: loss {logged['loss']!r}, grad_norm {logged['grad_norm']!r}; "
              f"relative difference of the aipo trajectory ({result['dtype']}, pinned kernels): "
              + ", ".join(f"{k} {v:.1e}" for k, v in rel.items()))
    write_expected(data)
    print(f"wrote {golden.EXPECTED.relative_to(REPO)}")


def largest_difference(got: dict[str, Any], want: dict[str, Any]) -> tuple[float, float, str]:
    """(largest relative difference over the float metrics of every trajectory and step, largest absolute one
    over the values near 0, where the test's ATOL rather than its RTOL applies (below ATOL / RTOL: mismatch_kl of
    step 1), where the relative one is). An int metric that differs gives infinity."""
    rel, near_zero, where = 0.0, 0.0, ""
    for name, steps in want.items():
        for n, (g, w) in enumerate(zip(got[name], steps, strict=True), start=1):
            for key, value in w.items():
                if isinstance(value, int):
                    if g[key] != value:
                        return float("inf"), float("inf"), f"{name} step {n} {key}: {g[key]} vs {value}"
                    continue
                diff = abs(g[key] - value)
                if abs(value) * golden.RTOL < golden.ATOL:
                    near_zero = max(near_zero, diff)
                elif diff / abs(value) > rel:
                    rel, where = diff / abs(value), f"{name} step {n} {key}"
    return rel, near_zero, where


def spread(dtype_name: str) -> None:
    """Each SPREAD_VARIANTS kernel path against the pinned child: the largest differences and RTOL's margin."""
    import torch

    dtype = getattr(torch, dtype_name)
    names = [*golden.TRAJECTORIES, *golden.PERTURBED]
    base = golden.compute_pinned(names, dtype=dtype)
    print(f"{dtype_name}, pinned child ({golden.PINNED_ENV}): torch kernels {base['capability']}, "
          f"{base['threads']} thread(s); versions {base['versions']}")
    worst, worst_abs = 0.0, 0.0
    for variant in SPREAD_VARIANTS:
        result = golden.compute_pinned(names, env=variant, dtype=dtype)
        rel, near_zero, where = largest_difference(result["results"], base["results"])
        other_init = result["capability"] == "DEFAULT"
        if not other_init:
            worst, worst_abs = max(worst, rel), max(worst_abs, near_zero)
        print(f"  {variant} -> torch kernels {result['capability']}, {result['threads']} thread(s): relative "
              f"{rel:.1e} ({where}), absolute near 0 {near_zero:.1e}"
              + ("  [DEFAULT kernels: another LoRA init; not counted]" if other_init else ""))
    used = max(worst / golden.RTOL, worst_abs / golden.ATOL)
    print(f"largest spread: relative {worst:.1e}, absolute near 0 {worst_abs:.1e}; the test's RTOL {golden.RTOL:g} "
          f"and ATOL {golden.ATOL:g} leave a margin of " + (f"{1 / used:.0f}x" if used else "infinity"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", action="store_true", help="regenerate the batches with a real co-locate run")
    ap.add_argument("--record", action="store_true", help="recompute expected.json on the committed batches")
    ap.add_argument("--spread", action="store_true",
                    help="measure the spread of the trajectories between kernel paths (changes nothing)")
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64", help="of --spread's trajectories")
    args = ap.parse_args()
    if not (args.batches or args.record or args.spread):
        ap.error("give --batches, --record and/or --spread (see the module docstring)")
    if args.batches:
        make_batches()
    if args.record:
        record()
    if args.spread:
        spread(args.dtype)


if __name__ == "__main__":
    main()
