"""The import paths users rely on keep working: the ones the docs name (`tidal.x.y` references, `package.module:fn`
import paths, `from tidal... import ...` lines in README.md and docs/*.md) all resolve, the TRL front is importable
from the package root and from `tidal.api`, the root of `src/tidal` holds only the entry point and the run directory
(every other module lives in a package), and an import path of a module that moved is refused with its new path."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
REFERENCE = re.compile(r"`(tidal(?:\.[A-Za-z_][A-Za-z_0-9]*)+)(?::([A-Za-z_][A-Za-z_0-9]*))?")
"""A backticked `tidal.a.b`, `tidal.a.b.name` or `tidal.a.b:name`."""
FROM_IMPORT = re.compile(r"^\s*from (tidal(?:\.[a-z_0-9]+)*) import ([A-Za-z_, ]+)$", re.M)
ROOT_MODULES = {"__init__.py", "cli.py", "paths.py", "checkpoint.py"}
"""The entry point (`tidal` = `tidal.cli:main`) and the run directory (its paths, its checkpoints)."""


def resolve(ref: str) -> str | None:
    """Why the dotted `ref` (a module, then attributes; a pydantic model's field counts) does not resolve."""
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if not module.startswith(exc.name or "\0"):  # the module exists, but something it imports does not
                return f"importing {module}: {exc}"
            continue
        for name in parts[i:]:
            fields = getattr(obj, "model_fields", {})
            if not hasattr(obj, name) and name not in fields:
                return f"{module} has no {'.'.join(parts[i:])}"
            obj = getattr(obj, name, None)
        return None
    return "no such module"


def documented() -> dict[str, str]:
    """Every reference the docs make: ref -> the file that makes it (the first)."""
    refs: dict[str, str] = {}
    for doc in DOCS:
        text = doc.read_text()
        for m in REFERENCE.finditer(text):
            refs.setdefault(m.group(1) + (f".{m.group(2)}" if m.group(2) else ""), doc.name)
        for m in FROM_IMPORT.finditer(text):
            for name in m.group(2).split(","):
                refs.setdefault(f"{m.group(1)}.{name.strip()}", doc.name)
    return refs


def test_every_reference_the_docs_make_resolves():
    refs = documented()
    assert len(refs) > 50, "the docs' references were found"
    bad = {ref: f"{doc}: {why}" for ref, doc in refs.items() if (why := resolve(ref)) is not None}
    assert bad == {}


def test_resolve_catches_a_stale_reference():
    assert resolve("tidal.api.GRPOTrainer") is None and resolve("tidal.config.train.ExportSection.gguf") is None
    assert "has no" in (resolve("tidal.api.NoSuchThing") or "")
    assert resolve("tidal.reward_model") == "tidal has no reward_model"


def test_the_trl_front_is_one_object_wherever_it_is_imported_from():
    import tidal
    import tidal.api
    from tidal import GRPOConfig, GRPOTrainer
    from tidal.api.grpo_config import GRPOConfig as Config
    from tidal.api.trainer import GRPOTrainer as Trainer

    assert GRPOConfig is tidal.api.GRPOConfig is Config and GRPOTrainer is tidal.api.GRPOTrainer is Trainer
    assert issubclass(tidal.api.RefusedConfig, ValueError)


def test_the_root_holds_only_the_entry_point_and_the_run_directory():
    root = REPO / "src" / "tidal"
    assert {p.name for p in root.glob("*.py")} == ROOT_MODULES


@pytest.mark.parametrize(("old", "new"), [("tidal.reward_model:reward_model", "tidal.rewards.model:reward_model"),
                                          ("tidal.sandbox:run_python", "tidal.rewards.sandbox:run_python")])
def test_an_import_path_of_a_module_that_moved_is_refused_with_its_new_path(old, new):
    from tidal.orchestrator.advantage import load_function

    with pytest.raises(ValueError, match=re.escape(f"write '{new}'")):
        load_function(old)
    assert callable(load_function(new))
