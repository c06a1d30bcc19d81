"""Regenerate the golden trajectory data of `tests/unit/test_golden_trajectory.py` (`tests/data/golden/`).

Two modes (both may be given; `--batches` runs first):

`--batches`: run one short real co-locate `tidal grpo` on the bundled model (vLLM on CPU, about a minute on 2
cores) with the bundled reverse-text example and these overrides:

    tidal grpo --orch.max_steps 3 --orch.batch_size 16 --orch.rollouts_per_example 8 \\
               --infer.port <free port> --output-dir <temporary directory>

and copy the orchestrator's `rollouts/step_{1,2,3}.safetensors` (2 prompts x 8 rollouts each, ~17 KB) into
`tests/data/golden/`. The command and the losses and grad norms the run's own trainer logged are kept in
`expected.json` (`source_run`): the `aipo` trajectory is that trainer's configuration, so `--record`
reproduces them up to the kernel difference (the run used the CPU's native kernels: a few 1e-6 relative).
Sampling is not seeded, so every `--batches` gives new batches; run `--record` after it.

`--record`: recompute the expected numbers: every trajectory of the test, by the test's own code (a child
process with torch and MKL pinned to AVX2 kernels, one thread, deterministic algorithms; needs an x86-64 CPU
with AVX2) on the committed batches, written to `expected.json` as repr floats with the batches' sha256, the
configs and the torch/transformers/peft versions used.

Re-record ONLY when a numeric change of the trainer is intended (and say why in the commit): the golden test
exists to catch the unintended ones.

Run: `.venv/bin/python scripts/make_golden.py --record` (a few seconds), or `--batches --record` (about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.unit import test_golden_trajectory as golden  # noqa: E402

OVERRIDES = ["--orch.max_steps", "3", "--orch.batch_size", "16", "--orch.rollouts_per_example", "8",
             "--orch.sampling.max_tokens", "24"]  # short enough that some completions are truncated


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        with open(log, "w") as f:
            rc = subprocess.run([sys.executable, "-m", "tidal.cli", *cmd[1:]], cwd=REPO, env=env, stdout=f,
                                stderr=subprocess.STDOUT, timeout=900).returncode
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
    data["recorded_with"] = result["versions"] | {"threads": result["threads"], "env": golden.PINNED_ENV}
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
              f"relative difference of the aipo trajectory (pinned kernels): "
              + ", ".join(f"{k} {v:.1e}" for k, v in rel.items()))
    write_expected(data)
    print(f"wrote {golden.EXPECTED.relative_to(REPO)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", action="store_true", help="regenerate the batches with a real co-locate run")
    ap.add_argument("--record", action="store_true", help="recompute expected.json on the committed batches")
    args = ap.parse_args()
    if not (args.batches or args.record):
        ap.error("give --batches and/or --record (see the module docstring)")
    if args.batches:
        make_batches()
    if args.record:
        record()


if __name__ == "__main__":
    main()
