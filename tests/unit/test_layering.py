"""The layering the import-linter contracts state (pyproject.toml, `make lint`), checked where it matters at
run time: the CPU-side processes never load the GPU stack."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _loaded_after(code: str) -> set[str]:
    """Top-level modules loaded by a fresh interpreter after running `code`."""
    script = textwrap.dedent(code) + textwrap.dedent("""
        import sys
        print(" ".join(sorted({m.split(".")[0] for m in sys.modules})))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return set(r.stdout.split())


def test_the_orchestrator_loads_no_torch(tmp_path):
    """Every orchestrator module, the transports, the weight-sync protocol, configs, environments, and a run's
    TensorBoard sink: none of them loads torch, transformers, peft or vllm."""
    loaded = _loaded_after(f"""
        import pkgutil, importlib
        import tidal.orchestrator, tidal.transport, tidal.envs, tidal.config
        for pkg in (tidal.orchestrator, tidal.transport, tidal.config):
            for m in pkgutil.iter_modules(pkg.__path__):
                importlib.import_module(f"{{pkg.__name__}}.{{m.name}}")
        import tidal.transport.weights, tidal.paths, tidal.checkpoint, tidal.monitor.sinks
        from pathlib import Path
        import numpy as np
        from tidal.config.orch import ReportSection
        from tidal.monitor.sinks import Sinks
        sinks = Sinks(ReportSection(wandb=False), Path({str(tmp_path)!r}), {{}})
        sinks.record_samples(1, [{{"prompt": "p", "completion": "c", "reward": 1.0, "advantage": 0.5}}],
                             np.array([1.0, 0.0]), np.array([0.5, -0.5]))
        sinks.close(last_step=None)
    """)
    assert "tidal" in loaded and "numpy" in loaded  # the probe itself works
    assert not loaded & {"torch", "transformers", "peft", "vllm"}, sorted(loaded & {"torch", "transformers", "peft"})


def test_the_probe_sees_torch_when_it_is_loaded():
    """The check above can fail: the trainer's modules do load torch."""
    assert "torch" in _loaded_after("import tidal.trainer.grpo")
