"""The llama.cpp side of the GGUF-out checks (tests/e2e/test_gguf_*_llama_cpp.py): where the llama-cpp-python
build lives, the marks that skip a check without it, and one run of `tests/e2e/llama_cpp_greedy.py` in a child
process (the build is imported there only: it is not on this interpreter's path)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LLAMA_CPP = Path(os.environ.get("TIDAL_LLAMA_CPP") or ROOT / ".venv" / "llama-cpp")
"""The llama-cpp-python build (`make llama-cpp`), or the directory `TIDAL_LLAMA_CPP` names."""

MARKS = [
    pytest.mark.slow,
    pytest.mark.skipif(not (LLAMA_CPP / "llama_cpp").is_dir(),
                       reason=f"no llama.cpp build at {LLAMA_CPP}: run `make llama-cpp` (llama-cpp-python from its "
                              "sdist, ~15-20 min on 2 cores) or set TIDAL_LLAMA_CPP"),
    pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs gguf (make setup-dev installs it)"),
]
"""A test module's `pytestmark`: slow, and skipped (naming what to install) without llama.cpp or gguf."""


def greedy_report(model: Path, texts: list[str], specials: list[str], steps: int, tmp: Path,
                  f32_cache: bool) -> dict:
    """What tests/e2e/llama_cpp_greedy.py reports for `model`: `steps` greedy tokens after each text, and how
    llama.cpp tokenizes `specials`."""
    req = tmp / f"{model.stem}.json"
    req.write_text(json.dumps({"texts": texts, "specials": specials, "max_tokens": steps, "f32_cache": f32_cache}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(LLAMA_CPP), *sys.path])}
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "e2e" / "llama_cpp_greedy.py"), str(model), str(req)],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
