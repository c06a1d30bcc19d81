"""Issue 68, start-up: vLLM's saved compiled model on CPU (infer `aot_compile`,
`tidal.inference.backends.vllm.aot_cpu`). A real `tidal grpo-infer` on the bundled model without LoRA (the server
`tidal grpo` runs on CPU, whose model vLLM compiles), three starts on one fresh vLLM cache: `auto` finds nothing
saved, compiles as without AOT and saves nothing (tidal's line); `true` compiles and saves; `auto` again loads it
(vLLM's own lines; no "Compiling model again"). All three serve the same distribution: the prompt logprobs of a
fixed sequence and the seeded samples equal."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL, free_port, kill_group, tidal, wait_healthy
from tidal.inference.backends.vllm import aot_cpu

pytestmark = pytest.mark.vllm

SAVED, LOADED, RECOMPILED = "saved AOT compiled function", "Directly load AOT compilation", "Compiling model again"
NOTHING_SAVED = aot_cpu.NOTHING_SAVED_LINE


def serve_once(tmp_path: Path, name: str, env: dict[str, str], *args: str) -> tuple[str, list[float], list[list[int]]]:
    """Start, score and sample, stop: (log, prompt logprobs of a fixed sequence, seeded samples' token ids)."""
    port, log = free_port(), tmp_path / f"{name}.log"
    with open(log, "w") as f:
        proc = tidal("grpo-infer", "--infer.port", str(port), "--infer.enable_lora", "false", *args, stdout=f,
                     env=env)
        try:
            wait_healthy(port, proc)
            url = f"http://127.0.0.1:{port}/v1/completions"
            ids = [5, 17, 9, 33, 2, 41, 8, 12, 26, 3]
            r = httpx.post(url, timeout=120, json={"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 1.0,
                                                  "prompt_logprobs": 0})
            assert r.status_code == 200, r.text
            plp = r.json()["choices"][0]["prompt_logprobs"]
            scored = [next(iter(p.values()))["logprob"] for p in plp[1:]]
            r = httpx.post(url, timeout=120, json={"model": MODEL, "prompt": ids, "max_tokens": 12, "temperature": 1.0,
                                                  "n": 4, "seed": 3, "return_token_ids": True})
            assert r.status_code == 200, r.text
            samples = [c["token_ids"] for c in r.json()["choices"]]
        finally:
            kill_group(proc)
    return log.read_text(), scored, samples


@pytest.mark.slow  # three vLLM starts with cold compiles (~110 s on 2 cores): make test-all; the decision and the
# artifact's checks are unit-tested in the default suite (tests/unit/test_aot_cpu.py)
def test_auto_compiles_without_saving_true_saves_and_auto_then_loads_the_same_model(tmp_path):
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}
    env.pop("VLLM_USE_AOT_COMPILE", None)
    plain, scored0, samples0 = serve_once(tmp_path, "auto-empty", env)
    assert NOTHING_SAVED in plain and SAVED not in plain and LOADED not in plain, plain[-3000:]
    first, scored1, samples1 = serve_once(tmp_path, "true", env, "--infer.aot_compile", "true")
    assert SAVED in first, first[-3000:]
    second, scored2, samples2 = serve_once(tmp_path, "auto-saved", env)
    assert LOADED in second and RECOMPILED not in second and SAVED not in second, second[-3000:]
    assert len(scored1) == 9 and all(x < 0 for x in scored1)
    assert scored2 == pytest.approx(scored1, abs=1e-5) and samples2 == samples1
    assert scored0 == pytest.approx(scored1, abs=1e-5) and samples0 == samples1
