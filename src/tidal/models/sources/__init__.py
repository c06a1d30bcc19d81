"""Where a model name becomes a directory — the one answer (`resolve_model`), for every component:

- `tidal:NAME`: a bundled model (`tidal.assets`), or a real model installed wheels carry as a GGUF file, whole or
  in chunks (`wheels.PACKAGED`: `tidal:smollm2-135m-instruct`, `tidal:gemma3-270m`);
- a `.gguf` file (or a directory holding one and no config.json): its dequantized copy in tidal's cache (`gguf`,
  converted once in a child process, `gguf_dequant`);
- an existing local directory: itself;
- `org/name[@revision]`: its snapshot in the Hugging Face cache (`hub`), downloaded if needed and allowed.

`check_local_model` refuses a local name that resolves to no complete model directory before anything starts.
Torch-free (the dequantization runs in its own process); what a directory holds is `tidal.models.files`' question.
"""

from __future__ import annotations

from pathlib import Path

from tidal.assets import ASSETS, PREFIX
from tidal.config.load import ConfigError
from tidal.models.files import check_weights, is_local, is_model_dir
from tidal.models.sources.wheels import PACKAGED, packaged

__all__ = ["PACKAGED", "bundled", "check_local_model", "packaged", "resolve_model"]


def resolve_model(name: str) -> str:
    """The directory a config's `model` names: `tidal:tiny-reverse` -> the bundled model; `tidal:NAME` of
    `PACKAGED` and a `.gguf` file (or a directory holding one and no config.json) -> its dequantized copy in
    tidal's cache (`gguf`, converted once); an existing local directory -> unchanged (it wins over a
    Hub id of the same spelling); `org/name[@revision]` -> its snapshot in the Hugging Face cache, downloaded if
    needed and allowed (`hub.resolve_hub_model`, which raises `HubModelError`, a FileNotFoundError; the GGUF
    refusals, `GGUFModelError`, are FileNotFoundErrors too); anything else unchanged (the caller finds no model
    directory there, `tidal.models.files`)."""
    if name in PACKAGED:
        name = packaged(name)
    elif name.startswith(PREFIX):
        return bundled(name)
    from tidal.models.sources.gguf import resolve_gguf

    gguf_dir = resolve_gguf(name)
    if gguf_dir is not None:
        return gguf_dir
    if Path(name).expanduser().is_dir():
        return name
    from tidal.models.sources.hub import resolve_hub_model

    return resolve_hub_model(name) or name


def bundled(name: str) -> str:
    """`tidal:NAME` -> absolute path of the bundled model NAME (FileNotFoundError listing them if none). What the
    directory holds is the caller's question, as for any local directory (`tidal.models.files.is_model_dir`)."""
    known = sorted(p.name for p in ASSETS.iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    if name[len(PREFIX):] not in known:
        raise FileNotFoundError(f"no bundled model '{name}' (bundled: {', '.join(PREFIX + k for k in known)}; "
                                f"from installed wheels: {', '.join(PACKAGED)})")
    return str(ASSETS / name[len(PREFIX):])


def check_local_model(model: str, source: str) -> None:
    """Refuse a local directory `model` names (a `tidal:` name or an existing path) that is no model directory or
    holds no complete weights; a Hub id passes unresolved (nothing is downloaded here). For models loaded later
    by name (a reward model), where `tidal.models.arch.check_model` would download a Hub id up front."""
    if not is_local(model):
        return
    try:
        path = resolve_model(model)
    except FileNotFoundError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if not is_model_dir(path):
        raise ConfigError(f"{source}: '{model}' is not a model directory (no config.json in {Path(path).resolve()})")
    check_weights(model, path, source)
