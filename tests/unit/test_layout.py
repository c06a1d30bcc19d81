"""The source tree stays readable (docs/design.md, "Code map"): no import circle, no module in src/tidal, scripts/
or bench/ over 600 lines, no function over 80. The allow-list (src/tidal; scripts/ and bench/ have none) names the
offenders left; it may only shrink: an entry that is back under the limit fails too, so that it is removed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "tidal"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
ALLOWED: set[str] = set()


def lines(node: ast.AST) -> int:
    return int(getattr(node, "end_lineno", 0) or 0) - int(getattr(node, "lineno", 0)) + 1


def offenders(source: str, rel: str) -> dict[str, int]:
    """`rel` (a module over the limit) or `rel::function` (a function over it) -> its length in lines."""
    found: dict[str, int] = {}
    if (n := len(source.splitlines())) > MAX_MODULE_LINES:
        found[rel] = n
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines(node) > MAX_FUNCTION_LINES:
            found[f"{rel}::{node.name}"] = lines(node)
    return found


def test_no_module_over_600_lines_and_no_function_over_80():
    found: dict[str, int] = {}
    for path in sorted(SRC.rglob("*.py")):
        found |= offenders(path.read_text(), path.relative_to(SRC).as_posix())
    new = {k: v for k, v in found.items() if k not in ALLOWED}
    assert not new, f"split these (a module: move a concept out; a function: name its steps): {new}"
    fixed = sorted(ALLOWED - set(found))
    assert not fixed, f"back under the limit: remove {fixed} from ALLOWED"


TOOLS = [SRC.parents[1] / "scripts", SRC.parents[1] / "bench"]
"""The benches and GPU checks: the same rule, with an empty allow-list (issue 48)."""


def test_benches_and_scripts_keep_the_same_rule():
    found: dict[str, int] = {}
    for root in TOOLS:
        for path in sorted(root.rglob("*.py")):
            found |= offenders(path.read_text(), path.relative_to(root.parent).as_posix())
    assert not found, f"split these (a module: move a concept out; a function: name its steps): {found}"


def test_the_check_sees_a_long_module_and_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert offenders(f"def f():\n{body}\n", "m.py") == {"m.py::f": MAX_FUNCTION_LINES + 1}
    at_limit = "\n".join(body.splitlines()[:-1])  # def line + 79 statements: 80 lines, allowed
    assert offenders(f"async def g():\n{at_limit}\n", "m.py") == {}
    module = "\n".join(f"x{i} = {i}" for i in range(MAX_MODULE_LINES + 1))
    assert offenders(module, "m.py") == {"m.py": MAX_MODULE_LINES + 1}


def test_the_import_graph_has_no_circle():
    """No module imports itself through others (lazy imports inside functions included: grimp reads them all);
    import-linter's `acyclic_siblings` contracts say the same per package, this says it for the whole tree."""
    import sys

    grimp = pytest.importorskip("grimp")  # comes with import-linter (`dev` extra)
    sys.path.insert(0, str(SRC.parent))
    try:
        graph = grimp.build_graph("tidal", cache_dir=None)
    finally:
        sys.path.remove(str(SRC.parent))
    circles = [m for m in graph.modules
               if any(graph.chain_exists(importer=i, imported=m) for i in graph.find_modules_directly_imported_by(m))]
    assert not circles, f"modules on an import circle: {sorted(circles)}"


def test_every_top_level_package_has_a_layer():
    """A new wing (a package or module directly under src/tidal) is placed in import-linter's layers contract
    (pyproject.toml), so `make lint` checks which way its imports point; one left out is checked by nothing."""
    import tomllib

    config = tomllib.loads((SRC.parents[1] / "pyproject.toml").read_text())
    layers = next(c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers")["layers"]
    named = {name.strip() for layer in layers for name in layer.split("|")}
    tops = {f"tidal.{p.stem}" for p in SRC.glob("*.py") if p.stem != "__init__"}
    tops |= {f"tidal.{p.name}" for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    assert not tops - named, f"place these in the layers contract of pyproject.toml: {sorted(tops - named)}"
    assert not named - tops, f"the layers contract names modules that are gone: {sorted(named - tops)}"
