"""Models by Hugging Face Hub id (`tidal.models.sources.hub`): a real HF cache layout on disk, never the network.

The cache is built as huggingface_hub writes it: `{HF_HUB_CACHE}/models--ORG--NAME/` with `blobs/<sha256>`,
`snapshots/<commit>/<file>` symlinks to `../../blobs/<sha256>` and `refs/main` holding the commit hash. Tests
run with HF_HUB_OFFLINE=1 and HF_HOME in a tmp directory; the one download path is a fake `snapshot_download`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tidal.assets import ASSETS
from tidal.config import InferConfig
from tidal.models.sources import resolve_model

REPO_ID = "tidal-test/tiny-reverse"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
BUNDLED = ASSETS / "tiny-reverse"


def build_cache(hub: Path, repo: str = REPO_ID, commit: str = COMMIT, skip: tuple[str, ...] = ()) -> Path:
    """Lay out `repo` at `commit` (the bundled model's files, less `skip`) as huggingface_hub's cache; the snapshot."""
    storage = hub / f"models--{repo.replace('/', '--')}"
    snap, blobs = storage / "snapshots" / commit, storage / "blobs"
    snap.mkdir(parents=True, exist_ok=True)
    blobs.mkdir(exist_ok=True)
    for f in sorted(BUNDLED.iterdir()):
        if f.name in skip:
            continue
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blobs / sha)
        (snap / f.name).symlink_to(Path("..", "..", "blobs", sha))
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    return snap


def hf_env(home: Path, offline: bool = True) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    return {**env, "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_HUB_OFFLINE": "1" if offline else "0"}


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An empty HF cache in tmp, offline (environment for subprocesses, huggingface_hub's constants in process)."""
    from huggingface_hub import constants

    home = tmp_path / "hf"
    (home / "hub").mkdir(parents=True)
    for key, value in hf_env(home).items():
        if key.startswith("HF_"):
            monkeypatch.setenv(key, value)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return home / "hub"


def run_cli(*args: str, home: Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tidal.cli", *args], capture_output=True, text=True, timeout=120,
                          env=hf_env(home), cwd=cwd)


def test_cache_layout_is_what_huggingface_hub_reads(hub):
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    snap = build_cache(hub)
    info = scan_cache_dir(hub)
    assert not info.warnings
    [repo] = info.repos
    assert repo.repo_id == REPO_ID and [r.commit_hash for r in repo.revisions] == [COMMIT]
    assert try_to_load_from_cache(REPO_ID, "config.json") == str(snap / "config.json")


def test_hub_id_resolves_to_the_cached_snapshot(hub):
    snap = build_cache(hub)
    assert resolve_model(REPO_ID) == str(snap)
    assert resolve_model(f"{REPO_ID}@{COMMIT}") == str(snap)
    assert resolve_model(f"{REPO_ID}@main") == str(snap)


def test_local_directory_wins_over_a_hub_id(hub, tmp_path, monkeypatch):
    build_cache(hub)
    shutil.copytree(BUNDLED, tmp_path / REPO_ID)
    monkeypatch.chdir(tmp_path)
    assert resolve_model(REPO_ID) == REPO_ID


def test_names_that_are_no_repo_id_are_left_alone(hub, tmp_path):
    from tidal.models.sources.hub import parse_hub_id

    for name in (str(tmp_path / "nope"), "./a/b", "a/b/c", "a--b/c", "gpt2", "../x", "./x", "~/x"):
        assert parse_hub_id(name) is None, name
        assert resolve_model(name) == name
    assert parse_hub_id("Qwen/Qwen3-0.6B") == ("Qwen/Qwen3-0.6B", None)
    assert parse_hub_id("Qwen/Qwen3-0.6B@v1.0") == ("Qwen/Qwen3-0.6B", "v1.0")


def test_offline_uncached_id_is_an_error_naming_id_and_cache(hub):
    from tidal.models.sources.hub import HubModelError

    with pytest.raises(HubModelError, match="tidal-test/absent") as err:
        resolve_model("tidal-test/absent")
    message = str(err.value)
    assert str(hub) in message and "HF_HUB_OFFLINE" in message and "local model directory" in message
    assert isinstance(err.value, FileNotFoundError)  # check_model_dir's and model_vocab_size's contract


def test_offline_partial_snapshot_is_an_error(hub):
    from tidal.models.sources.hub import HubModelError

    build_cache(hub, skip=("model.safetensors",))  # e.g. only config and tokenizer were ever fetched
    with pytest.raises(HubModelError, match="only partly in"):
        resolve_model(REPO_ID)


def test_offline_snapshot_missing_a_listed_file_is_an_error(hub):
    """huggingface_hub's own completeness check: its tree listing names a file the snapshot lacks."""
    from tidal.models.sources.hub import HubModelError

    build_cache(hub)
    entry = {"size": 1, "blob_id": "0" * 40}
    trees = hub / "models--tidal-test--tiny-reverse" / "trees"
    trees.mkdir()
    (trees / f"{COMMIT}.json").write_text(json.dumps(
        {"format_version": 1, "files": {"config.json": entry, "tokenizer_extra.json": entry}}))
    with pytest.raises(HubModelError, match="only partly in"):
        resolve_model(REPO_ID)


def test_online_downloads_once_with_the_model_patterns(hub, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants

    real = huggingface_hub.snapshot_download
    downloads: list[dict] = []

    def fake(repo_id, **kw):
        if kw["local_files_only"]:
            return real(repo_id, **kw)
        downloads.append({"repo_id": repo_id, **kw})
        return str(build_cache(hub))

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    snap = resolve_model(REPO_ID)
    assert resolve_model(REPO_ID) == snap == str(hub / "models--tidal-test--tiny-reverse" / "snapshots" / COMMIT)
    assert len(downloads) == 1, "the second resolution finds the cache"
    assert downloads[0]["revision"] is None and downloads[0]["ignore_patterns"] == ["*/*"]


def test_download_patterns_keep_only_what_a_model_needs():
    from huggingface_hub.utils import filter_repo_objects

    from tidal.models.sources.hub import ALLOW_PATTERNS, IGNORE_PATTERNS

    repo = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt", "special_tokens_map.json",
            "chat_template.jinja", "README.md", ".gitattributes", "LICENSE", "pytorch_model.bin",
            "consolidated.safetensors", "original/model.safetensors", "onnx/model.onnx", "figures/chart.png"]
    kept = set(filter_repo_objects(repo, allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS))
    assert kept == set(repo[:12])


def test_online_unknown_repo_is_an_error(hub, monkeypatch):
    import httpx2
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import RepositoryNotFoundError

    from tidal.models.sources.hub import HubModelError

    def fake(repo_id, **kw):
        if kw["local_files_only"]:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        response = httpx2.Response(404, request=httpx2.Request("GET", "https://huggingface.co/api/models/x"))
        raise RepositoryNotFoundError("404", response=response)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    with pytest.raises(HubModelError, match="neither a local directory nor a model on the Hugging Face Hub"):
        resolve_model("tidal-test/typo")


def test_vllm_gets_the_snapshot_and_serves_the_id(hub):
    from tidal.inference.backends.vllm.server import vllm_argv

    snap = build_cache(hub)
    argv = vllm_argv(InferConfig(model=REPO_ID))
    assert argv[argv.index("--model") + 1] == str(snap)
    assert argv[argv.index("--served-model-name") + 1] == REPO_ID


def test_trainer_loads_tokenizer_and_model_from_the_id(hub):
    import torch

    from tidal.trainer.model.load import load_base_model, load_tokenizer

    build_cache(hub)
    tok = load_tokenizer(REPO_ID)
    model = load_base_model(REPO_ID, torch.device("cpu"), torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": "abc"}], add_generation_prompt=True)
    assert len(ids) > 0 and len(tok) <= model.config.vocab_size
    assert model.config.name_or_path == str(hub / "models--tidal-test--tiny-reverse" / "snapshots" / COMMIT)


def test_orchestrator_vocab_size_reads_the_cached_config(hub):
    from tidal.orchestrator.filters import model_vocab_size

    build_cache(hub)
    assert model_vocab_size(REPO_ID) == json.loads((BUNDLED / "config.json").read_text())["vocab_size"]


def test_cli_grpo_dry_run_with_a_hub_id(hub, tmp_path):
    build_cache(hub)
    r = run_cli("grpo", "--dry-run", "--output-dir", str(tmp_path / "run"), "--train.model", REPO_ID,
                "--infer.model", REPO_ID, "--orch.model.name", REPO_ID, home=hub.parent)
    assert r.returncode == 0, r.stderr
    train, infer, orch = [yaml.safe_load(part.split("---\n", 1)[1]) for part in r.stdout.split("# --- ")[1:]]
    assert train["model"] == infer["model"] == orch["model"]["name"] == REPO_ID, "configs keep the name as written"


def test_cli_offline_uncached_id_exits_2_naming_id_and_cache(hub, tmp_path):
    r = run_cli("grpo", "--dry-run", "--output-dir", str(tmp_path / "run"), "--train.model", "tidal-test/absent",
                home=hub.parent)
    assert r.returncode == 2, r.stderr
    assert "tidal-test/absent" in r.stderr and str(hub) in r.stderr and "key 'model'" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_non_repo_id_keeps_the_directory_message(hub, tmp_path):
    r = run_cli("grpo-train", "--dry-run", "--train.model", "a/b/c", home=hub.parent, cwd=tmp_path)
    assert r.returncode == 2 and "'a/b/c' is not a model directory" in r.stderr
