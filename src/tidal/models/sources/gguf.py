"""GGUF files as a model source: `model: path/to/file.gguf` (or a directory holding one `.gguf` and no config.json)
-> a Hugging Face model directory in tidal's cache, dequantized once, which vLLM, the trainer and the tokenizer then
load like any local model (`tidal.models.sources.resolve_model` calls `resolve_gguf`).

- Cache: `$TIDAL_CACHE/gguf/<sha256 of the file, 16 hex>/` (`TIDAL_CACHE` defaults to `$XDG_CACHE_HOME/tidal`, else
  `~/.cache/tidal`). An entry is complete only with its `STABLE` marker; it is written under a temporary name in the
  same directory and renamed, so a killed conversion never leaves an entry that is used. The content hash of a file is
  remembered by (path, size, mtime) (`hashes/`), so a large file is read once, not at every start.
- Conversion: transformers + PyPI's `gguf` (the `gguf` extra) dequantize the file (`from_pretrained(gguf_file=...)`,
  float32), in a child process (`python -m tidal.models.sources.gguf_dequant`: this
  module stays torch-free, and so does the
  `tidal grpo` parent that resolves a model before anything starts). The entry holds float32 safetensors, the
  tokenizer and chat template the file carries, `gguf_source.json` (file, hash, architecture, tensor types) and
  `gguf_tokenizer.json`: what the file says about its tokenizer beyond what transformers keeps (`tokenizer.ggml.pre`,
  the token types, add_bos/add_eos), so a GGUF export of the trained model writes them as the source had them
  without the source file (`tidal.trainer.publish.gguf_vocab`). An entry converted before that record existed gets
  it the next time it is resolved (the source file is at hand then).
- Refusals (`GGUFModelError`, a FileNotFoundError: the command line turns it into exit 2, before anything starts),
  read from the file's header without reading its tensors: an architecture transformers cannot read as GGUF
  (`supported_architectures`), a tensor type `gguf` cannot dequantize (`dequantizable_types`), no tokenizer in the
  file, no `gguf` package, or a directory with no or several `.gguf` files.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tidal import procs
from tidal.paths import STABLE, atomic_dir, write_atomic

SUFFIX = ".gguf"
SOURCE_FILE = "gguf_source.json"
TOKENIZER_FILE = "gguf_tokenizer.json"
"""The source file's tokenizer facts in a cache entry (`tokenizer_facts`); merged/ exports copy it along."""
HASH_CHARS = 16
"""The hex characters of the content hash that name a cache entry."""
DEQUANT_TIMEOUT_S = 3600.0
"""Seconds one dequantization child may take (an 8B model takes minutes on 2 cores); then its group is killed."""
ARCH_RENAMES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
"""GGUF architecture names transformers reads under another name (`load_gguf_checkpoint`)."""
NOT_CAUSAL = {"t5", "umt5", "general", "tokenizer"}
"""Keys of transformers' GGUF config mapping that are no causal-LM architecture."""
INSTALL = "pip install gguf (tidal's extra: pip install -e '.[gguf]')"


class GGUFModelError(FileNotFoundError):
    """A GGUF model source that cannot be used: no such file, unsupported content, or the conversion failed."""


@dataclass(frozen=True)
class GGUFInfo:
    """What a GGUF file's header says (no tensor data read)."""

    architecture: str
    """`general.architecture`, e.g. `llama`."""
    tensor_types: dict[str, int]
    """Tensor type name (`Q4_1`, `F32`, ...) -> how many tensors have it."""
    has_tokenizer: bool
    """The file carries a tokenizer (`tokenizer.ggml.tokens`)."""


def cache_root() -> Path:
    """tidal's cache: `TIDAL_CACHE`, else `$XDG_CACHE_HOME/tidal`, else `~/.cache/tidal`."""
    if os.environ.get("TIDAL_CACHE"):
        return Path(os.environ["TIDAL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "tidal"


def gguf_file(name: str) -> Path | None:
    """The GGUF file `name` names: a `.gguf` file, or a directory without config.json holding `.gguf` files (exactly
    one, else GGUFModelError); None when `name` names no GGUF source (a model directory, a Hub id, ...)."""
    p = Path(name).expanduser()
    if p.suffix.lower() == SUFFIX and not p.is_dir():
        if not p.is_file():
            raise GGUFModelError(f"GGUF model file {p} does not exist")
        return p.resolve()
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    found = sorted(f for f in p.iterdir() if f.suffix.lower() == SUFFIX and f.is_file())
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(f.name for f in found[:4])
        raise GGUFModelError(f"directory {p.resolve()} holds {len(found)} GGUF files ({names}); name the one to "
                             "use (model: path/to/file.gguf)")
    return found[0].resolve()


def content_hash(path: Path) -> str:
    """sha256 of the file's bytes (hex), remembered under `hashes/` by (path, size, mtime) so it is read once."""
    st = path.stat()
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = cache_root() / "hashes" / key
    if memo.is_file():
        return memo.read_text().strip()
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    write_atomic(memo, digest)
    return digest


def read_info(path: Path) -> GGUFInfo:
    """The header of the GGUF file `path` (`gguf.GGUFReader` maps the file; no tensor is dequantized)."""
    reader = gguf_reader(path)
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else "?"
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return GGUFInfo(architecture=str(arch), tensor_types=types,
                    has_tokenizer="tokenizer.ggml.tokens" in reader.fields)


def gguf_reader(path: Path):  # type: ignore[no-untyped-def]
    try:
        import gguf
    except ImportError:
        raise GGUFModelError(f"model {path}: reading a GGUF file needs the `gguf` package; {INSTALL}") from None
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise GGUFModelError(f"model {path} is no readable GGUF file ({type(exc).__name__}: {exc})") from None


def tokenizer_facts(path: Path) -> dict[str, object]:
    """What the GGUF file `path` says about its tokenizer that transformers' GGUF tokenizer does not keep:
    `pre` (llama.cpp's pre-tokenizer id, `tokenizer.ggml.pre`), `token_types` (one `gguf.TokenType` per token),
    `add_bos_token` / `add_eos_token` (absent when the file does not say); for a SentencePiece (`llama`) vocabulary
    also `model`, the `tokens` as the file spells them (transformers respells added whitespace tokens with `▁`) and
    their `scores` (the merge priorities llama.cpp's SPM tokenizer uses, which transformers' merges only approximate).
    """
    fields = gguf_reader(path).fields
    out: dict[str, object] = {"file": str(path)}
    spm = fields.get("tokenizer.ggml.model") is not None and fields["tokenizer.ggml.model"].contents() == "llama"
    for key, name in (("tokenizer.ggml.pre", "pre"), ("tokenizer.ggml.token_type", "token_types"),
                      ("tokenizer.ggml.add_bos_token", "add_bos_token"),
                      ("tokenizer.ggml.add_eos_token", "add_eos_token"), ("tokenizer.ggml.model", "model"),
                      ("tokenizer.ggml.tokens", "tokens"), ("tokenizer.ggml.scores", "scores")):
        field = fields.get(key)
        if field is not None and (spm or name not in ("model", "tokens", "scores")):
            value = field.contents()
            if name == "token_types":
                value = [int(v) for v in value]
            elif name == "scores":
                value = [float(v) for v in value]
            out[name] = value
    return out


def record_tokenizer(path: Path, entry: Path) -> None:
    """Write `gguf_tokenizer.json` (`tokenizer_facts` of `path`) into the cache entry `entry` (atomically)."""
    write_atomic(entry / TOKENIZER_FILE, json.dumps(tokenizer_facts(path)))


def supported_architectures() -> list[str]:
    """The GGUF architectures transformers converts to a causal LM (its GGUF config mapping; torch-free import)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return sorted(k for k in GGUF_CONFIG_MAPPING if k not in NOT_CAUSAL)


def dequantizable_types() -> list[str]:
    """The tensor types `gguf.dequantize` turns into floats: plain F32/F16/BF16/F64 and the quantized ones it knows."""
    from gguf.quants import _type_traits

    return sorted({"F32", "F16", "F64", *(t.name for t in _type_traits)})


def check_supported(path: Path, info: GGUFInfo) -> None:
    """Refuse what transformers + gguf cannot turn into a model directory (GGUFModelError, naming the file and what
    is supported)."""
    archs = supported_architectures()
    arch = ARCH_RENAMES.get(info.architecture, info.architecture)
    if arch not in archs:
        raise GGUFModelError(f"model {path}: GGUF architecture '{info.architecture}' cannot be dequantized by "
                             f"transformers; supported: {', '.join(archs)}")
    bad = sorted(set(info.tensor_types) - set(dequantizable_types()))
    if bad:
        raise GGUFModelError(f"model {path}: tensor type(s) {', '.join(bad)} cannot be dequantized by gguf; "
                             f"supported: {', '.join(dequantizable_types())}")
    if not info.has_tokenizer:
        raise GGUFModelError(f"model {path}: the GGUF file carries no tokenizer (tokenizer.ggml.tokens); tidal needs "
                             "the tokenizer from the file (llama.cpp's convert_hf_to_gguf.py writes it)")


def is_complete(entry: Path) -> bool:
    """A cache entry that was renamed into place (its STABLE marker exists)."""
    return (entry / STABLE).is_file()


def resolve_gguf(name: str) -> str | None:
    """The cached HF model directory of the GGUF source `name` (converted now if it is not cached); None when `name`
    names no GGUF source."""
    path = gguf_file(name)
    if path is None:
        return None
    entry = cache_root() / "gguf" / content_hash(path)[:HASH_CHARS]
    if is_complete(entry):
        if not (entry / TOKENIZER_FILE).is_file():  # converted before the record existed
            record_tokenizer(path, entry)
        return str(entry)
    info = read_info(path)
    check_supported(path, info)
    convert(path, info, entry)
    return str(entry)


def convert(path: Path, info: GGUFInfo, entry: Path) -> None:
    """Dequantize `path` into the cache entry `entry`: a child process fills a temporary directory beside it, which
    becomes the entry once complete (`tidal.paths.atomic_dir`; another process that got there first wins, and its
    entry is equal). The temp is removed when the conversion fails or times out (`DEQUANT_TIMEOUT_S`:
    GGUFModelError, exit 2); one left by a run that was killed (its pid is in the name) is removed by the next
    conversion (`paths.sweep_temps`)."""
    size_mb = path.stat().st_size / 2**20
    types = ", ".join(f"{k} x{v}" for k, v in sorted(info.tensor_types.items()))
    print(f"[tidal] dequantizing {path.name} ({size_mb:.0f} MB, {info.architecture}, tensors {types}) once into "
          f"{entry} (float32; later runs reuse it)", file=sys.stderr, flush=True)
    with atomic_dir(entry, keep_complete=True) as tmp:
        _dequantize(path, tmp)
        write_atomic(tmp / SOURCE_FILE, json.dumps({"file": str(path), "sha256": content_hash(path),
                                                    "architecture": info.architecture,
                                                    "tensor_types": info.tensor_types}, indent=1))
        record_tokenizer(path, tmp)
        restore_bos(tmp)


def restore_bos(entry: Path) -> None:
    """Make the entry's tokenizer prepend its BOS token when the GGUF file says so (`add_bos_token` in
    `gguf_tokenizer.json`): transformers' GGUF tokenizer drops that flag (Gemma 3's `<bos>`: the converted
    tokenizer encodes without it, and Gemma's output degrades badly without it), so tokenizer.json gets a
    post-processor that prepends BOS (what `from_pretrained(add_bos_token=True)` writes) and tokenizer_config.json
    `add_bos_token: true`. Nothing changes when the file says no or its tokenizer already adds BOS."""
    facts = json.loads((entry / TOKENIZER_FILE).read_text())
    cfg_path, tok_path = entry / "tokenizer_config.json", entry / "tokenizer.json"
    if facts.get("add_bos_token") is not True or not cfg_path.is_file() or not tok_path.is_file():
        return
    cfg, tok = json.loads(cfg_path.read_text()), json.loads(tok_path.read_text())
    bos = cfg.get("bos_token")
    ids = [t["id"] for t in tok.get("added_tokens", []) if t.get("content") == bos]
    post = tok.get("post_processor") or {}
    if not isinstance(bos, str) or not ids or "SpecialToken" in json.dumps(post.get("single", [])):
        return
    special = {"SpecialToken": {"id": bos, "type_id": 0}}
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [special, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [special, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": bos, "type_id": 1}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": ids[:1], "tokens": [bos]}}}
    write_atomic(tok_path, json.dumps(tok, ensure_ascii=False))
    write_atomic(cfg_path, json.dumps({**cfg, "add_bos_token": True}, indent=2))


def _dequantize(path: Path, tmp: Path) -> None:
    """Run the dequantization child into `tmp`; GGUFModelError (exit 2) when it fails or outlives its time."""
    # a child in its own process group that dies with this process (tidal.procs.run); an hour bounds a stuck one
    try:
        cmd = [sys.executable, "-m", "tidal.models.sources.gguf_dequant", str(path), str(tmp)]
        proc = procs.run(cmd, DEQUANT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise GGUFModelError(f"model {path}: dequantizing the GGUF file took longer than {DEQUANT_TIMEOUT_S:g} s "
                             f"(tidal.models.sources.gguf.DEQUANT_TIMEOUT_S); it was stopped and its partial copy "
                             f"removed. "
                             f"Convert it once on a faster machine or give an HF model directory") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise GGUFModelError(f"model {path}: dequantizing the GGUF file failed (exit {proc.returncode}):\n{tail}")
