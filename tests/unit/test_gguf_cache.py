"""The GGUF source cache (`models.sources.gguf.convert`) leaves no float32 copy behind: a dequantization that outlives
`DEQUANT_TIMEOUT_S` is a config error (GGUFModelError -> ConfigError, exit 2) and its temp directory is removed; a
run killed mid-conversion leaves a temp named with its pid, which the next conversion removes (its writer is gone)
before it converts. Real children throughout (the dequantization child, a killed `resolve_model` process); the
GGUF is written from a random-init tiny Llama (tests/unit/test_gguf_models.py's builder)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="the gguf extra (pip install -e '.[gguf]'; make setup-dev installs it)")
pytest.importorskip("torch")

from tests.unit.test_gguf_models import tiny_model  # noqa: E402
from tidal.config.load import ConfigError  # noqa: E402
from tidal.models.arch import check_model  # noqa: E402
from tidal.models.sources import gguf as gguf_source  # noqa: E402
from tidal.models.sources import resolve_model  # noqa: E402
from tidal.models.sources.gguf import GGUFModelError, is_complete  # noqa: E402
from tidal.trainer.publish.gguf_out import write_gguf  # noqa: E402


@pytest.fixture
def gguf_file(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    model = tiny_model(src)
    return write_gguf(model.state_dict().items(), src, tmp_path / "g" / "tiny.gguf", "f32")


def temps(cache: Path) -> list[Path]:
    root = cache / "gguf"
    return sorted(p for p in root.iterdir() if p.name.startswith(".") and ".tmp" in p.name) if root.is_dir() else []


def test_a_dequantization_timeout_is_a_config_error_and_leaves_no_copy(gguf_file, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_source, "DEQUANT_TIMEOUT_S", 0.5)  # the child imports transformers for longer
    with pytest.raises(GGUFModelError, match=r"took longer than 0.5 s .*DEQUANT_TIMEOUT_S.*partial copy removed"):
        resolve_model(str(gguf_file))
    with pytest.raises(ConfigError, match=r"train.yaml: key 'model': .*took longer than 0.5 s"):
        check_model(str(gguf_file), "train.yaml")  # what the command line turns into exit 2
    cache = tmp_path / "cache"
    assert temps(cache) == [] and not any(is_complete(p) for p in (cache / "gguf").iterdir())


@pytest.mark.slow  # a killed conversion, then a whole one (~30 s on 2 cores)
def test_a_killed_conversion_leaves_a_temp_the_next_one_removes(gguf_file, tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "TIDAL_CACHE": str(cache), "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", f"from tidal.models.sources import resolve_model; "
                             f"resolve_model({str(gguf_file)!r})"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        while not temps(cache) and time.monotonic() - t0 < 120 and proc.poll() is None:
            time.sleep(0.05)
        left = temps(cache)
        assert left, "the conversion's temp directory appeared"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the run is killed mid-conversion (its dequant child dies with it)
        proc.wait()
    assert temps(cache) == left and str(proc.pid) in left[0].name, "a killed run cannot clean up after itself"
    path = resolve_model(str(gguf_file))
    assert is_complete(Path(path)) and temps(cache) == [], "the next conversion removed the dead run's temp"
