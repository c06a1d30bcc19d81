"""Models by Hugging Face Hub id: `org/name` (or `org/name@revision`) -> its snapshot directory in the HF cache.

The cache is looked up first (`HF_HOME` / `HF_HUB_CACHE`, as huggingface_hub reads them): a snapshot of the
revision that holds a config.json and its safetensors weights is used as it is, without the network. So
`tidal grpo` downloads a model at most once, in the parent before anything starts (`tidal.models.arch.check_model`),
and its children (vLLM, trainer, orchestrator) then find the same snapshot (`refs/{revision}` names it). A model
that is not cached, or only partly, is downloaded with `snapshot_download` (only the files a model needs:
`ALLOW_PATTERNS`, top level only) unless `HF_HUB_OFFLINE` is set; a cached model is not updated (run
`hf download org/name` or pin `@revision` for a newer commit). Failures raise `HubModelError` (a
FileNotFoundError; the command line turns it into exit 2) naming the model and the cache directory.

huggingface_hub is imported only when a name looks like a Hub id (no torch, transformers or vLLM here).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tidal.models.files import is_model_dir, missing_weights

ALLOW_PATTERNS = ["config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
                  "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                  "chat_template.*", "*.tiktoken", "*.py"]
"""The files a causal LM needs: config, weights (+ shard index), tokenizer files, chat template, and the
model's own code (top-level `*.py`, used only with `trust_remote_code: true`)."""
IGNORE_PATTERNS = ["*/*"]
"""Nothing below the top level (other formats, e.g. `original/`, `onnx/`)."""
HUB_ID = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")


class HubModelError(FileNotFoundError):
    """A Hub model that cannot be had: not cached while offline, unknown on the Hub, or without weights."""


def parse_hub_id(name: str) -> tuple[str, str | None] | None:
    """`org/name` -> ('org/name', None), `org/name@rev` -> ('org/name', 'rev'); None when `name` is no repo id."""
    m = HUB_ID.fullmatch(name)
    if m is None:
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(m["repo"])
    except HFValidationError:
        return None
    return m["repo"], m["revision"]


def is_complete(path: Path) -> bool:
    """A snapshot holds a config.json and every weight file it needs (`tidal.models.files.missing_weights`; only
    safetensors are downloaded: `ALLOW_PATTERNS`)."""
    return is_model_dir(path) and missing_weights(path) is None


def cache_dir() -> str:
    """The Hub cache huggingface_hub uses (HF_HUB_CACHE, else HF_HOME/hub)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def is_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def snapshot(repo: str, revision: str | None, local_only: bool) -> Path:
    """`snapshot_download` of the model files (raises huggingface_hub's errors)."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                  ignore_patterns=IGNORE_PATTERNS, local_files_only=local_only))


def cached_snapshot(repo: str, revision: str | None) -> tuple[Path | None, str]:
    """The cached snapshot of `repo` at `revision` when it holds config and weights, else (None, why not)."""
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        path = snapshot(repo, revision, local_only=True)
    except IncompleteSnapshotError:
        return None, "incomplete"
    except LocalEntryNotFoundError:
        return None, "not cached"
    return (path, "") if is_complete(path) else (None, "incomplete")


def offline_error(name: str, why: str) -> HubModelError:
    state = "is not in" if why == "not cached" else "is only partly in"
    return HubModelError(
        f"model '{name}' {state} the Hugging Face cache at {cache_dir()} and HF_HUB_OFFLINE is set, so it cannot be "
        "downloaded; go online (unset HF_HUB_OFFLINE) to download it, set HF_HOME (or HF_HUB_CACHE) to a cache that "
        "holds it, or give the path of a local model directory")


def download(name: str, repo: str, revision: str | None) -> Path:
    """Download the model files of `repo` into the cache; HubModelError when the Hub cannot provide them."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    print(f"[tidal] downloading model '{name}' from the Hugging Face Hub into {cache_dir()}", file=sys.stderr,
          flush=True)
    fix = "or give the path of a local model directory"
    try:
        path = snapshot(repo, revision, local_only=False)
    except RevisionNotFoundError:
        raise HubModelError(f"model '{name}': the Hub repository '{repo}' has no revision '{revision}'") from None
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise HubModelError(
            f"model '{name}' is neither a local directory nor a model on the Hugging Face Hub that this machine may "
            f"read ({exc.__class__.__name__}); check the spelling, log in (`hf auth login`) for a gated or private "
            f"model, {fix}") from None
    except (LocalEntryNotFoundError, HfHubHTTPError) as exc:
        reason = f"{exc.__class__.__name__}: {str(exc).splitlines()[0]}"
        raise HubModelError(f"model '{name}': cannot download it from the Hugging Face Hub into {cache_dir()} "
                            f"({reason}); check the network, {fix}") from None
    if not is_complete(path):
        raise HubModelError(f"model '{name}': the Hub repository holds no config.json with safetensors weights "
                            f"(tidal loads *.safetensors only; downloaded to {path})")
    return path


def resolve_hub_model(name: str) -> str | None:
    """Snapshot directory of the Hub model `name` (cached, else downloaded); None when `name` is no repo id."""
    parsed = parse_hub_id(name)
    if parsed is None:
        return None
    repo, revision = parsed
    path, why = cached_snapshot(repo, revision)
    if path is not None:
        return str(path)
    if is_offline():
        raise offline_error(name, why)
    return str(download(name, repo, revision))
